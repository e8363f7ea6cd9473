"""The `dataset` backend: each prompt answered by its own record's assistant turns, no model call.

A prompt shard names each prompt's record (`source`: file and line); the job reads those records
again, parses them as the prompts stage did (the same layout parser and call linking) and puts the
record's assistant turns back between the prompt's own turns: plain answers, and the recorded
tool-call turns (`finish_reason: tool_calls`), whose results the prompt already holds. The rows are
those the model backends write (docs/formats.md), without `output_ids`: the tokens stage rebuilds
each turn from its text. A turn's reasoning written inline (`<think>...</think>` before the answer)
is split off into `reasoning` as the reasoning parsers split a model's output, with the think tokens
the model's tokenizer has; a model without them keeps the text as written.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from eagle3_datagen.chat.template import load_tokenizer, resolve_special_tokens
from eagle3_datagen.formats.datasets import (
    BadRecord,
    SkipRecord,
    conversation_id,
    link_tool_calls,
    parse,
    prompt_messages,
)
from eagle3_datagen.formats.files import InputError, read_jsonl, write_json, write_jsonl_zst
from eagle3_datagen.formats.sources import Source, iter_source, resolve
from eagle3_datagen.stages.responses.conversation import response_stats, through_last_reply, throughput

log = logging.getLogger(__name__)

BACKEND = "dataset"
# A row that ends before its prompt's last user turn, because the record answers it with nothing.
UNANSWERED = "no_recorded_answer"
CHANGED = "the source changed after the prompts stage read it: rerun the partition's prompts, then its responses"


def split_reasoning(text: str, think_start: str | None, think_end: str | None) -> tuple[str, str]:
    """(reasoning, content) of an answer written as `<think>reasoning</think>content`, trimmed as
    `chat.template.split_output_ids` trims a model's; the whole text is content without a think end."""
    if not think_end or think_end not in text:
        return "", text
    thought, content = text.split(think_end, 1)
    thought = thought.lstrip()
    if think_start and thought.startswith(think_start):
        thought = thought[len(think_start) :]
    return thought.strip("\n"), content.lstrip("\n")


def answer_turn(message: dict, index: int, think: tuple[str | None, str | None]) -> dict:
    """A record's assistant turn in the responses' layout (`Turn.as_message`), turn `index` of the row."""
    reasoning, content = split_reasoning(message.get("content") or "", *think)
    turn = {
        "role": "assistant",
        "content": content,
        "reasoning": reasoning,
        "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
        "usage": {},
        "turn": index,
    }
    if message.get("tool_calls"):
        turn["tool_calls"] = message["tool_calls"]
    return turn


def recorded_turns(prompt: dict, record: dict, fmt: str, system_prompt: str | None, where: tuple[str, int]):
    """The record's conversation, linked as the prompts stage links it, checked to be the one `prompt`
    was built from (same content id)."""
    try:
        _, parsed = parse(record, fmt)
        messages, _ = link_tool_calls(parsed.messages)
        same = conversation_id(prompt_messages(messages, system_prompt), parsed.tools) == prompt["id"]
    except (BadRecord, SkipRecord):
        same = False
    if not same:
        raise InputError(*where, f"the record is no longer the one prompt {prompt['id']} was built from", CHANGED)
    return messages


def original_row(prompt: dict, recorded: list[dict], think: tuple[str | None, str | None]) -> dict:
    """`prompt`'s row answered by the record's own turns (`recorded`: the record's linked conversation)."""
    skeleton = prompt["messages"]
    at = 0
    messages: list[dict] = []
    # A system prompt the partition inserted, or one that replaced the record's empty one.
    first = recorded[0] if recorded else {}
    if skeleton[0]["role"] == "system" and (first.get("role") != "system" or not first["content"].strip()):
        messages.append(skeleton[0])
        at = 1
    for message in recorded:
        if message["role"] == "assistant" and not message.get("tool_calls"):
            if (message.get("content") or "").strip():  # an empty answer is none
                messages.append(answer_turn(message, sum(m["role"] == "assistant" for m in messages), think))
            continue
        if message["role"] == "system" and not message["content"].strip():
            continue  # the prompts stage drops an empty system turn
        kept = skeleton[at]
        at += 1
        if kept["role"] == "assistant":  # a recorded tool-call turn: the dataset's answer too
            kept = answer_turn(kept, sum(m["role"] == "assistant" for m in messages), think)
        messages.append(kept)
    answered = through_last_reply(messages)
    row = {
        "id": prompt["id"],
        "messages": answered,
        "source": prompt["source"],
        "backend": BACKEND,
        "model": BACKEND,
        "status": "ok",
    }
    if prompt.get("tools"):
        row["tools"] = prompt["tools"]
    if any(m["role"] == "user" for m in messages[len(answered) :]):
        row["ended"] = UNANSWERED
    return row


def think_tokens(model: dict) -> tuple[str | None, str | None]:
    """The model's think start and end, as the tokens stage resolves them (None: the model has none)."""
    tokenizer = load_tokenizer(model["path"], model["trust_remote_code"])
    specials = resolve_special_tokens(tokenizer, model["special_tokens"], model["chat_template_kwargs"])
    return specials.think_start, specials.think_end


def records_of(prompts: list[dict], dataset: dict) -> dict[tuple[str, int], dict]:
    """The records the prompts were built from, by (file, line), read from the partition's source."""
    wanted = {(p["source"]["file"], p["source"]["line"]) for p in prompts}
    spec = Source(dataset["source"], dataset.get("subset"), dataset.get("split"), dataset.get("revision"))
    found = {}
    for file, line, record in iter_source(resolve(spec)):
        if (file, line) in wanted:
            found[(file, line)] = record
    return found


def original_responses(
    prompts_path: str | Path,
    out_path: str | Path,
    stats_path: str | Path,
    dataset: dict,
    think: tuple[str | None, str | None],
) -> dict:
    """One shard's rows, every prompt answered by its record. `dataset`: the partition's source and layout
    (the response settings' `dataset`); `think`: the model's think tokens (`think_tokens`). Returns the
    stats written."""
    started = time.monotonic()
    prompts = read_jsonl(prompts_path)
    records = records_of(prompts, dataset) if prompts else {}
    rows = []
    for prompt in prompts:
        where = (prompt["source"]["file"], prompt["source"]["line"])
        if where not in records:
            raise InputError(
                *where,
                f"prompt {prompt['id']} ({prompts_path}) names this record, which the source no longer has",
                CHANGED,
            )
        recorded = recorded_turns(prompt, records[where], dataset["format"], dataset["system_prompt"], where)
        rows.append(original_row(prompt, recorded, think))
    write_jsonl_zst(out_path, rows)
    stats = {"backend": BACKEND, "model": BACKEND, "source": dataset["source"], **response_stats(rows)}
    stats["throughput"] = throughput(rows, time.monotonic() - started)
    stats["failed"] = {}
    write_json(stats_path, stats)
    log.info("%s: %d rows from %s (%s)", out_path, len(rows), dataset["source"], stats["ended"] or "all answered")
    return stats
