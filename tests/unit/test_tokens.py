import contextlib

import pytest

from eagle3_datagen.chat.template import TemplateError, encode, resolve_special_tokens, split_output_ids
from eagle3_datagen.stages.tokens import CHUNK_ROWS, TokenBuilder, build_samples, loss_spans
from eagle3_datagen.stages.tokens.turns import BoundaryError, ReasoningDroppedError
from tests.helpers import defaults, token_settings

SYSTEM = {"role": "system", "content": "You are terse."}


def user(text):
    return {"role": "user", "content": text}


def reply(content, reasoning="", finish_reason="stop", **extra):
    return {
        "role": "assistant",
        "content": content,
        "reasoning": reasoning,
        "finish_reason": finish_reason,
        "usage": {},
        **extra,
    }


def row(*messages, status="ok"):
    return {"id": "sample", "messages": list(messages), "status": status}


@pytest.fixture
def builder(qwen_tokenizer):
    def make(template_kwargs=None, **settings):
        specials = resolve_special_tokens(qwen_tokenizer)
        return TokenBuilder(qwen_tokenizer, specials, token_settings(**settings), template_kwargs)

    return make


@contextlib.contextmanager
def swapped_template(tokenizer, template):
    original = tokenizer.chat_template
    tokenizer.chat_template = template
    try:
        yield
    finally:
        tokenizer.chat_template = original


def masked_spans(tokenizer, sample):
    """Decoded text of each contiguous run of loss-mask 1s."""
    return [
        tokenizer.decode(s, skip_special_tokens=False) for s in loss_spans(sample["input_ids"], sample["loss_mask"])
    ]


def test_special_tokens_are_read_from_the_tokenizer(qwen_tokenizer):
    specials = resolve_special_tokens(qwen_tokenizer)
    assert (specials.end_of_turn, specials.end_of_turn_id) == ("<|im_end|>", 151645)
    assert (specials.think_start_id, specials.think_end_id) == (151667, 151668)


def test_wrong_special_token_configuration_fails_loudly(qwen_tokenizer):
    with pytest.raises(TemplateError, match=r"'<\|eot_id\|>' encodes to \d+ IDs"):
        resolve_special_tokens(qwen_tokenizer, {"end_of_turn": "<|eot_id|>"})


@pytest.mark.parametrize("system", [[], [SYSTEM]], ids=["no-system", "system"])
def test_single_turn_mask_is_the_assistant_turn_and_end_of_turn(builder, qwen_tokenizer, system):
    [sample] = builder().samples_for(row(*system, user("Hi"), reply("Hello there.")))
    assert masked_spans(qwen_tokenizer, sample) == ["<think>\n\n</think>\n\nHello there.<|im_end|>"]
    text = qwen_tokenizer.decode(sample["input_ids"], skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nHello there.<|im_end|>")
    assert text.startswith("<|im_start|>system\nYou are terse." if system else "<|im_start|>user\nHi")


@pytest.mark.parametrize("system", [[], [SYSTEM]], ids=["no-system", "system"])
def test_multi_turn_masks_every_assistant_turn_as_rendered(builder, qwen_tokenizer, system):
    conversation = row(*system, user("Hi"), reply("Hello.", "greet"), user("Bye"), reply("Goodbye.", "part"))
    [sample] = builder().samples_for(conversation)
    # keep_last: the template drops reasoning of turns before the last user turn
    assert masked_spans(qwen_tokenizer, sample) == ["Hello.<|im_end|>", "<think>\npart\n</think>\n\nGoodbye.<|im_end|>"]
    assert len(sample["input_ids"]) == len(sample["loss_mask"])


def test_thinking_off_generation_prompt_in_multi_turn(builder, qwen_tokenizer):
    # The generation prompt closes an empty think block that the template drops from past turns:
    # each turn still starts right after what the model saw.
    b = builder(template_kwargs={"enable_thinking": False})
    last_output = encode(qwen_tokenizer, "Goodbye.<|im_end|>")
    [sample] = b.samples_for(row(user("Hi"), reply("Hello."), user("Bye"), reply("Goodbye.", output_ids=last_output)))
    assert masked_spans(qwen_tokenizer, sample) == ["Hello.<|im_end|>", "Goodbye.<|im_end|>"]
    text = qwen_tokenizer.decode(sample["input_ids"], skip_special_tokens=False)
    assert text.endswith(
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nGoodbye.<|im_end|>"
    )
    assert b.report()["audit"]["exact"] == 1


def test_thinking_drop_and_keep_all(builder, qwen_tokenizer):
    conversation = row(user("Hi"), reply("Hello.", "greet"), user("Bye"), reply("Goodbye.", "part"))
    [dropped] = builder(thinking="drop").samples_for(conversation)
    assert masked_spans(qwen_tokenizer, dropped) == ["Hello.<|im_end|>", "<think>\n\n</think>\n\nGoodbye.<|im_end|>"]
    per_turn = builder(thinking="keep_all").samples_for(conversation)
    assert [s["id"] for s in per_turn] == ["sample/0", "sample/1"]
    assert [masked_spans(qwen_tokenizer, s) for s in per_turn] == [
        ["<think>\ngreet\n</think>\n\nHello.<|im_end|>"],
        ["<think>\npart\n</think>\n\nGoodbye.<|im_end|>"],
    ]


def test_server_ids_are_audited_and_preferred(builder, qwen_tokenizer):
    prefix = encode(qwen_tokenizer, "<think>\n\n</think>\n\n")
    exact = prefix + encode(qwen_tokenizer, "Hello there.") + [151645]
    bpe = prefix + encode(qwen_tokenizer, "Hel") + encode(qwen_tokenizer, "lo there.") + [151645]
    semantic = prefix + encode(qwen_tokenizer, "Hello here.") + [151645]
    b = builder(audit_examples=1)
    samples = [
        b.samples_for(row(user("Hi"), reply("Hello there.", output_ids=ids)))[0] for ids in (exact, bpe, semantic)
    ]
    audit = b.report()["audit"]
    assert (audit["exact"], audit["bpe_only"], audit["semantic"]) == (1, 1, 1)
    assert audit["semantic_rate"] == pytest.approx(1 / 3)
    assert [e["kind"] for e in audit["examples"]] == ["bpe_only", "semantic"]
    # trained on the server's IDs: the masked tokens are exactly what was generated
    for sample, ids in zip(samples, (exact, bpe, semantic), strict=True):
        assert [t for t, m in zip(sample["input_ids"], sample["loss_mask"], strict=True) if m] == ids
    [from_text] = builder(prefer_ids="text").samples_for(row(user("Hi"), reply("Hello there.", output_ids=bpe)))
    assert [t for t, m in zip(from_text["input_ids"], from_text["loss_mask"], strict=True) if m] == exact


@pytest.mark.parametrize("n", [1, 2])
def test_text_and_server_ids_give_identical_samples(builder, qwen_tokenizer, n):
    turns = [user("Hi"), reply("Hello.", "greet"), user("Bye"), reply("Goodbye.", "part")][: 2 * n]
    [from_text] = builder().samples_for(row(*turns))
    # Qwen3's generation prompt leaves the think block to the model: its output opens it.
    output = encode(qwen_tokenizer, f"<think>\n{turns[-1]['reasoning']}\n</think>\n\n{turns[-1]['content']}<|im_end|>")
    b = builder()
    [from_ids] = b.samples_for(row(*turns[:-1], {**turns[-1], "output_ids": output}))
    assert from_ids == from_text
    assert masked_spans(qwen_tokenizer, from_ids)[-1] == qwen_tokenizer.decode(output)
    assert (b.report()["audit"]["exact"], b.report()["counts"]["ids_from_server"]) == (1, 1)


def test_truncated_rows_dropped_or_kept_without_end_of_turn(builder, qwen_tokenizer):
    truncated = row(user("Hi"), reply("Hello th", finish_reason="length"), status="truncated")
    b = builder()
    assert b.samples_for(truncated) == []
    assert b.report()["gates"]["dropped"] == {"sample": ["truncated"]}
    [kept] = builder(gates={"truncated": False}).samples_for(truncated)
    assert masked_spans(qwen_tokenizer, kept) == ["<think>\n\n</think>\n\nHello th"]


def test_length_policy(builder):
    long = row(user("Hi"), reply(" ".join(f"word{i}" for i in range(50))))  # no loop: the gates pass it
    b = builder(max_length=40, length_policy="drop")
    assert b.samples_for(long) == [] and b.report()["counts"]["dropped_too_long"] == 1
    [cut] = builder(max_length=40, length_policy="truncate").samples_for(long)
    assert len(cut["input_ids"]) == 40 and sum(cut["loss_mask"]) > 0


def test_prefix_unstable_template_names_the_sample(qwen_tokenizer):
    # A template that numbers turns from the end renders the history differently each time.
    specials = resolve_special_tokens(qwen_tokenizer)
    b = TokenBuilder(qwen_tokenizer, specials, token_settings())
    numbered = (
        "{% for m in messages %}<|im_start|>{{ m.role }} {{ messages|length - loop.index0 }}\n{{ m.content }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    prefix_error = pytest.raises(BoundaryError, match="sample sample: the chat template is not prefix-stable")
    with swapped_template(qwen_tokenizer, numbered), prefix_error:
        b.samples_for(row(user("Hi"), reply("Hello.")))


def test_split_output_ids_parses_think_blocks(qwen_tokenizer):
    specials = resolve_special_tokens(qwen_tokenizer)
    ids = encode(qwen_tokenizer, "<think>\nplan\n</think>\n\nDone.<|im_end|>")
    assert split_output_ids(qwen_tokenizer, ids, specials) == ("plan", "Done.", True, True, None)
    unclosed = encode(qwen_tokenizer, "<think>\n\nDone.<|im_end|>")
    assert split_output_ids(qwen_tokenizer, unclosed, specials).well_formed is False
    control = encode(qwen_tokenizer, "<|im_start|>user\nDone.<|im_end|>")
    assert split_output_ids(qwen_tokenizer, control, specials).well_formed is False
    closed_prompt = encode(qwen_tokenizer, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert split_output_ids(qwen_tokenizer, encode(qwen_tokenizer, "Done.<|im_end|>"), specials, closed_prompt) == (
        "",
        "Done.",
        True,
        True,
        None,
    )
    again = encode(qwen_tokenizer, "</think>\n\nDone.<|im_end|>")
    assert split_output_ids(qwen_tokenizer, again, specials, closed_prompt).well_formed is False
    open_prompt = encode(qwen_tokenizer, "<|im_end|>\n<|im_start|>assistant\n<think>\n")
    opened = encode(qwen_tokenizer, "plan\n</think>\n\nDone.<|im_end|>")
    assert split_output_ids(qwen_tokenizer, opened, specials, open_prompt) == ("plan", "Done.", True, True, None)
    never_closed = encode(qwen_tokenizer, "Done.")
    assert split_output_ids(qwen_tokenizer, never_closed, specials, open_prompt).well_formed is False
    plain = encode(qwen_tokenizer, "Done.")
    assert split_output_ids(qwen_tokenizer, plain, specials) == ("", "Done.", False, True, None)


def test_empty_think_block_of_the_trained_turn_is_filled_as_generated(qwen_tokenizer):
    # Like Kimi-K2.5's: completed assistant turns are rendered with an empty think block.
    blanking = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' %}<think>\n\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with swapped_template(qwen_tokenizer, blanking):
        specials = resolve_special_tokens(qwen_tokenizer)
        conversation = row(user("Hi"), reply("Hello.", "greet"), user("Bye"), reply("Goodbye.", "part"))
        [sample] = TokenBuilder(qwen_tokenizer, specials, token_settings()).samples_for(conversation)
        assert masked_spans(qwen_tokenizer, sample) == [
            "<think>\n\n</think>\n\nHello.<|im_end|>",
            "<think>\npart\n</think>\n\nGoodbye.<|im_end|>",
        ]


def test_template_that_drops_the_trained_turns_reasoning_fails_loudly(qwen_tokenizer):
    # No think block at all: the reasoning has nowhere to go.
    bare = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with swapped_template(qwen_tokenizer, bare):
        specials = resolve_special_tokens(qwen_tokenizer)
        b = TokenBuilder(qwen_tokenizer, specials, token_settings())
        with pytest.raises(ReasoningDroppedError, match="sample sample: the chat template renders the trained"):
            b.samples_for(row(user("Hi"), reply("Hello.", "think first")))
        [sample] = TokenBuilder(qwen_tokenizer, specials, token_settings(thinking="drop")).samples_for(
            row(user("Hi"), reply("Hello.", "think first"))
        )
        assert masked_spans(qwen_tokenizer, sample) == ["Hello.<|im_end|>"]


TRICKY_CONTENT = [
    "  leading spaces",
    "\n\nleading newlines",
    "def f(x):\n    return x  # 🙂\n",
    "中文回答，带标点。",
    "trailing\n",
    "ends with a tab\t",
]


def tricky_rows(n):
    rows = []
    for i in range(n):
        a, b = TRICKY_CONTENT[i % len(TRICKY_CONTENT)], TRICKY_CONTENT[(i * 5 + 1) % len(TRICKY_CONTENT)]
        messages = [user(f"question {i} {b}"), reply(a, "step one\n" if i % 2 else ""), user(b), reply(b + str(i))]
        rows.append({"id": f"r{i}", "messages": messages, "status": "ok"})
    return rows


def test_offset_boundaries_agree_with_prefix_reencoding(qwen_tokenizer):
    specials = resolve_special_tokens(qwen_tokenizer)
    rows = tricky_rows(36)
    by_offsets = TokenBuilder(qwen_tokenizer, specials, token_settings(), boundaries="offsets").samples_for_rows(rows)
    by_prefix = TokenBuilder(qwen_tokenizer, specials, token_settings(), boundaries="prefix").samples_for_rows(rows)
    assert len(by_offsets) == 36
    assert by_offsets == by_prefix


def test_worker_processes_give_the_same_samples_and_audit(kimi_remote_code_dir):
    rows = tricky_rows(CHUNK_ROWS * 2 + 7)
    for n, r in enumerate(rows):
        if n % 3 == 0:
            r["status"] = "truncated"
    model = defaults("model", trust_remote_code=True, special_tokens={"expected_ids": {"<|im_end|>": 163586}})
    # Kimi-K2.5 reasons before every answer and half these turns hold none: reasoning_missing is off, so
    # that the truncated rows are the only ones dropped.
    settings = token_settings(gates={"reasoning_missing": False})
    one, one_report = build_samples(rows, kimi_remote_code_dir, model, settings, workers=1)
    two, two_report = build_samples(rows, kimi_remote_code_dir, model, settings, workers=2)
    assert len(one) == len(rows) - len(range(0, len(rows), 3))
    assert one == two
    assert one_report == two_report
    assert one_report["gates"]["counts"]["truncated"] == len(range(0, len(rows), 3))
    # The model's tokenizer is slow (remote code): the fast one built from its tiktoken.model
    # encoded every sample, each checked to give the slow one's IDs.
    assert one_report["tokenizer"] == {
        "model": "TiktokenTokenizer (slow)",
        "encoder": "TokenizersBackend (fast)",
        "checked_against_model": True,
    }
    assert one_report["boundaries"] == "offsets"
    assert one_report["counts"]["encoder_checked_samples"] == len(one)
    assert "encoder_mismatched_samples" not in one_report["counts"]
