"""The probe on a random model's greedy data, and on deliberately broken variants of it.

A random model predicts nothing but its own greedy choices, so any position the probe is
pointed at wrongly shows: a prompt token in the mask, a state from the wrong layer, or a
context other than the one the response was generated in.
"""

import json

import pytest
import torch

from eagle3_datagen.backends.hf.capture import HFCapture
from eagle3_datagen.backends.hf.generate import HFBackend
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.formats import hidden_codec
from eagle3_datagen.formats.files import read_jsonl, write_jsonl_zst
from eagle3_datagen.stages.hidden.shard import capture_shard
from eagle3_datagen.stages.probe import LMHead, ProbeFailure, run_probe
from eagle3_datagen.stages.responses.journaled import Budgets, run_journaled_responses
from eagle3_datagen.stages.tokens import build_samples
from tests.helpers import defaults, probe_settings, tiny_qwen3, token_settings
from tests.helpers.captures import OffByOneCapture, ReversedAuxCapture

THINKING_OFF = defaults("model", chat_template_kwargs={"enable_thinking": False})
THINKING_ON = defaults("model", chat_template_kwargs={"enable_thinking": True})
HIDDEN = fill_defaults({"dtype": "float32", "shard_bytes": 1 << 20, "max_batch_tokens": 256}, "hidden_states")


@pytest.fixture(scope="module")
def random_model_dir(tmp_path_factory, qwen_tokenizer):
    torch.manual_seed(1)
    model = tiny_qwen3(len(qwen_tokenizer), tie_word_embeddings=False)
    with torch.no_grad():  # a final norm that is not all ones, so normed and raw states differ
        model.model.norm.weight.uniform_(-2.0, 2.0)
    path = tmp_path_factory.mktemp("random") / "model"
    model.save_pretrained(path, max_shard_size="10MB")  # sharded: the probe reads the index
    qwen_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def greedy_rows(random_model_dir, tmp_path_factory):
    prompts = [
        {"id": f"p{i}", "source": "test", "messages": [{"role": "user", "content": f"Question {i}: {topic}?"}]}
        for i, topic in enumerate(["rivers", "prime numbers", "sorting", "tides", "bread", "orbits"] * 2)
    ]
    backend = HFBackend(
        random_model_dir,
        defaults("inference.sampling", max_new_tokens=16, temperature=0.0),
        defaults("inference.hf", batch_size=4),
        THINKING_OFF,
    )
    work = tmp_path_factory.mktemp("greedy")
    write_jsonl_zst(work / "prompts.jsonl.zst", prompts)
    run_journaled_responses(work / "prompts.jsonl.zst", work / "out.jsonl.zst", work / "stats.json", backend, Budgets())
    return read_jsonl(work / "out.jsonl.zst")


def samples_for(rows, model_dir, model_settings=THINKING_OFF):
    # The rows answer with thinking off: rebuilt as if it were on (THINKING_ON), each would be dropped as
    # reasoning_missing, which is how the gates catch that mismatch; off here, so that the probe sees it.
    gates = {"truncated": False, "reasoning_missing": False}
    samples, _ = build_samples(rows, model_dir, model_settings, token_settings(gates=gates))
    return samples


def shard(
    tmp_path,
    name,
    samples,
    model_dir,
    final="normed",
    final_layer=None,
    storage=None,
    capture_class=HFCapture,
    aux="auto",
):
    capture = capture_class(model_dir, aux, final, {"dtype": "float32", "device": "cpu"})
    if final_layer is not None:
        capture.num_layers = final_layer  # a capture that takes the final state from another layer
    out = tmp_path / name
    capture_shard(samples, out, capture, {**HIDDEN, **(storage or {})})
    return out


# The shard's tokens audit as the probe reads it: 12 response rows, none dropped.
TOKENS_AUDIT = {"gates": {"rows": 12, "dropped_rows": 0, "counts": {"truncated": 0}}}


def probe(tmp_path, shard_dir, model_dir, greedy_exact=True, settings=None, tokens_audit=TOKENS_AUDIT):
    return run_probe(
        shard_dir,
        tmp_path / f"{shard_dir.name}.json",
        model_dir,
        settings or probe_settings(),
        "P1",
        "hf",
        greedy_exact,
        tokens_audit,
    )


def test_greedy_data_agrees_and_only_head_and_norm_are_read(tmp_path, random_model_dir, greedy_rows):
    result = probe(
        tmp_path, shard(tmp_path, "ok", samples_for(greedy_rows, random_model_dir), random_model_dir), random_model_dir
    )
    assert result["verdict"] == "ok"
    assert result["positions_probed"] == result["positions_total"] == 12 * 16
    assert result["last_turn"]["top1_agreement"] >= 0.99
    assert result["by_position"][0]["positions"] == 12
    assert result["tensors_loaded"] == ["lm_head.weight", "model.norm.weight"]
    written = json.loads((tmp_path / "ok.json").read_text())
    assert written["partition"] == "P1" and written["backend"] == "hf"


def test_a_shard_with_nothing_to_probe_fails_unless_its_prompt_shard_was_empty(tmp_path, random_model_dir, greedy_rows):
    """No trained position: every row failed or was gated (the tokens job fails such a shard first), or
    every sample's loss mask is empty. Only a shard without response rows is `empty`, not a failure."""
    unmasked = [{**s, "loss_mask": [0] * len(s["loss_mask"])} for s in samples_for(greedy_rows, random_model_dir)]
    gated = {"gates": {"rows": 12, "dropped_rows": 4, "counts": {"truncated": 3, "repetition": 1, "empty": 0}}}
    with pytest.raises(
        ProbeFailure,
        match=r"shard unmasked \(hf\): no position to probe: of its 12 response rows the "
        r"tokens stage dropped 4 \(truncated 3, repetition 1\) and the rest hold no trained token",
    ):
        probe(tmp_path, shard(tmp_path, "unmasked", unmasked, random_model_dir), random_model_dir, tokens_audit=gated)
    assert not (tmp_path / "unmasked.json").exists()
    empty = shard(tmp_path, "empty", [], random_model_dir)
    result = probe(
        tmp_path, empty, random_model_dir, tokens_audit={"gates": {"rows": 0, "dropped_rows": 0, "counts": {}}}
    )
    assert (result["verdict"], result["positions_total"]) == ("empty", 0)
    assert result["reasons"] == ["no position to probe: the shard's prompt shard holds no prompt"]


def test_lm_head_reads_two_tensors_of_a_sharded_checkpoint(random_model_dir):
    index = json.loads((random_model_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    head = LMHead(random_model_dir)
    assert head.loaded == ["lm_head.weight", "model.norm.weight"]
    assert tuple(head.weight.shape) == (151669, 32)


def test_shifted_loss_mask_fails(tmp_path, random_model_dir, greedy_rows):
    shifted = []
    for sample in samples_for(greedy_rows, random_model_dir):
        mask = sample["loss_mask"]
        shifted.append({**sample, "loss_mask": mask[1:] + [0]})  # one token early: the prompt's last
    with pytest.raises(ProbeFailure, match=r"partition P1, shard shifted .*first 4 response positions"):
        probe(tmp_path, shard(tmp_path, "shifted", shifted, random_model_dir), random_model_dir)


def test_wrong_final_layer_fails(tmp_path, random_model_dir, greedy_rows):
    samples = samples_for(greedy_rows, random_model_dir)
    wrong = shard(tmp_path, "layer7", samples, random_model_dir, final="raw", final_layer=7)
    with pytest.raises(ProbeFailure, match=r"top-1 agreement on the last turns is 0\.\d+.*Likely causes: a loss"):
        probe(tmp_path, wrong, random_model_dir)


def test_swapped_chat_template_fails(tmp_path, random_model_dir, greedy_rows):
    # Generated with thinking off; tokens rebuilt as if thinking were on: the model's context
    # lacks the closed think block it saw.
    samples = samples_for(greedy_rows, random_model_dir, THINKING_ON)
    with pytest.raises(ProbeFailure, match="first 4 response positions"):
        probe(tmp_path, shard(tmp_path, "swapped", samples, random_model_dir), random_model_dir)


def test_text_rebuilt_data_is_judged_on_log_probability(tmp_path, random_model_dir, greedy_rows):
    samples = samples_for(greedy_rows, random_model_dir, THINKING_ON)
    result = probe(tmp_path, shard(tmp_path, "text", samples, random_model_dir), random_model_dir, greedy_exact=False)
    assert result["greedy_exact"] is False
    assert result["verdict"] in ("ok", "warn")
    assert result["verdict"] == ("warn" if result["all"]["mean_logprob"] < -3.0 else "ok")


FP8 = {"dtype": "float8_e4m3", "scales": "token", "reference_positions": 64}


def test_fp8_storage_cost_is_measured_on_bf16_reference_rows(tmp_path, random_model_dir, greedy_rows):
    samples = samples_for(greedy_rows, random_model_dir)
    lossless = probe(tmp_path, shard(tmp_path, "bf16", samples, random_model_dir), random_model_dir)
    assert lossless["storage_cost"] is None and lossless["storage"]["dtype"] == "float32"
    result = probe(
        tmp_path,
        shard(tmp_path, "fp8", samples, random_model_dir, storage=FP8),
        random_model_dir,
        settings=probe_settings(max_agreement_drop=1.0, min_greedy_agreement=0.0, min_first_agreement=0.0),
    )
    cost = result["storage_cost"]
    assert result["storage"] == {
        "dtype": "float8_e4m3",
        "scales": {"granularity": "token", "dtype": "bfloat16"},
        "compress": None,
    }
    assert cost["positions"] == 64
    assert cost["reference"]["top1_agreement"] >= 0.9  # bf16 rows of float32 greedy data: near-ties flip
    assert cost["agreement_drop"] == cost["reference"]["top1_agreement"] - cost["stored"]["top1_agreement"]
    assert [layer["layer"] for layer in cost["layers"]] == [2, 4, 5, "final"]
    for layer in cost["layers"]:  # e4m3: 3 mantissa bits
        assert 0.005 < layer["relative_error"] < 0.04 and layer["cosine"] > 0.999


def test_lossy_storage_past_the_agreement_bound_fails(tmp_path, random_model_dir, greedy_rows, monkeypatch):
    """Real fp8 on this model stays within the bound; a reader that decodes the stored states with
    noise stands in for a storage setting too coarse for its states."""
    out = shard(tmp_path, "noisy", samples_for(greedy_rows, random_model_dir), random_model_dir, storage=FP8)
    real = hidden_codec.dequantize
    monkeypatch.setattr(hidden_codec, "dequantize", lambda v, s: real(v, s) + torch.randn(v.shape).bfloat16() * 3)
    with pytest.raises(
        ProbeFailure, match=r"float8_e4m3 storage loses 0\.\d+ top-1 agreement .*max_agreement_drop=0\.005"
    ):
        probe(tmp_path, out, random_model_dir)


SHARPEN = 30.0  # the LM head's scale: logits from near-uniform to a peaked distribution


@pytest.fixture(scope="module")
def sharp_model_dir(tmp_path_factory, qwen_tokenizer):
    """A random model whose LM head is scaled up: at temperature 1 it samples from a peaked distribution, as a
    trained model does, where the random model's near-uniform one (every token near -log V) leaves a
    sampled token no likelier from its own state than from any other."""
    torch.manual_seed(2)
    model = tiny_qwen3(len(qwen_tokenizer), tie_word_embeddings=False)
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 2.0)
        model.lm_head.weight.mul_(SHARPEN)
    path = tmp_path_factory.mktemp("sharp") / "model"
    model.save_pretrained(path)
    qwen_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def sampled_samples(sharp_model_dir, tmp_path_factory):
    """The sharp model's answers to 8 prompts at temperature 1, as token samples."""
    prompts = [
        {"id": f"s{i}", "source": "test", "messages": [{"role": "user", "content": f"Tell me about {topic}."}]}
        for i, topic in enumerate(["rivers", "prime numbers", "sorting", "tides", "bread", "orbits", "salt", "owls"])
    ]
    backend = HFBackend(
        sharp_model_dir,
        defaults("inference.sampling", max_new_tokens=24, temperature=1.0),
        defaults("inference.hf", batch_size=8),
        THINKING_OFF,
    )
    work = tmp_path_factory.mktemp("sampled")
    write_jsonl_zst(work / "prompts.jsonl.zst", prompts)
    run_journaled_responses(work / "prompts.jsonl.zst", work / "out.jsonl.zst", work / "stats.json", backend, Budgets())
    return samples_for(read_jsonl(work / "out.jsonl.zst"), sharp_model_dir)


SAMPLED_AUDIT = {"gates": {"rows": 8, "dropped_rows": 0, "counts": {}}}


def probe_sampled(tmp_path, shard_dir, model_dir):
    return probe(tmp_path, shard_dir, model_dir, greedy_exact=False, tokens_audit=SAMPLED_AUDIT)


def test_sampled_data_passes_the_floor_and_states_one_token_off_fail_it(tmp_path, sharp_model_dir, sampled_samples):
    """At temperature 1 only a fifth of the stored tokens are the head's top-1 (no agreement threshold can
    judge them), yet 95% are likelier from the state before them than from its neighbours; stored one row
    early, 1-2%: the earlier neighbour, the true state, wins instead."""
    model = sharp_model_dir
    good = probe_sampled(tmp_path, shard(tmp_path, "good", sampled_samples, model), model)
    assert good["verdict"] != "fail" and good["greedy_exact"] is False
    assert good["all"]["top1_agreement"] < 0.3 and good["all"]["positions"] == good["alignment"]["positions"] > 150
    assert good["alignment"]["aligned_best_share"] >= 0.9 and good["alignment"]["margin"] > 5.0
    assert good["final_norm"] == {**good["final_norm"], "normed_share": 1.0, "holds": "normed"}
    raw = probe_sampled(tmp_path, shard(tmp_path, "raw", sampled_samples, model, final="raw"), model)
    assert raw["alignment"]["aligned_best_share"] == pytest.approx(good["alignment"]["aligned_best_share"])
    assert (raw["final_norm"]["normed_share"], raw["final_norm"]["holds"]) == (0.0, "raw")
    # the normed final row divided by the norm's weight points where the raw one does: the same depth order
    assert good["aux_depth"]["rows"] == raw["aux_depth"]["rows"] == 192
    assert raw["aux_depth"]["median_cosine_with_final"] == pytest.approx(
        good["aux_depth"]["median_cosine_with_final"], abs=1e-3
    )
    assert raw["aux_depth"]["in_order_share"] == pytest.approx(good["aux_depth"]["in_order_share"], abs=0.02)
    off = shard(tmp_path, "off_by_one", sampled_samples, model, capture_class=OffByOneCapture)
    with pytest.raises(ProbeFailure, match=r"shard off_by_one \(hf\): [0-9.]+% of the stored tokens") as failure:
        probe_sampled(tmp_path, off, model)
    share = float(str(failure.value).split("): ")[1].split("%")[0]) / 100
    assert share < 0.1 and "final states stored one token off" in str(failure.value)
    assert "greedy, exact output IDs" not in str(failure.value)
    assert not (tmp_path / "off_by_one.json").exists()


def says_final(shard_dir, final):
    """The shard's index.json naming `final` for its final slot, whatever the capture stored there."""
    index = json.loads((shard_dir / "index.json").read_text())
    (shard_dir / "index.json").write_text(json.dumps({**index, "final": final}))
    return shard_dir


@pytest.mark.parametrize(("stored", "said"), [("raw", "normed"), ("normed", "raw")])
def test_a_final_slot_of_the_other_kind_than_index_json_says_fails(
    tmp_path, sharp_model_dir, sampled_samples, stored, said
):
    """A raw final layer where the norm's output is expected, or the other way round: the rows divided by the
    norm's weight have an RMS of exactly 1 only where the norm wrote them."""
    out = says_final(shard(tmp_path, "slot", sampled_samples, sharp_model_dir, final=stored), said)
    share = "0.0%" if stored == "raw" else "100.0%"
    says = rf"index.json says the final slot is {said}, but {share} of the probed rows .* holds {stored}"
    with pytest.raises(ProbeFailure, match=says):
        probe_sampled(tmp_path, out, sharp_model_dir)


def test_reversed_aux_layers_fail_the_floor(tmp_path, sharp_model_dir, sampled_samples):
    """Auxiliary layers stored in reverse order (5, 4, 2 where index.json names 2, 4, 5): the final slot's checks
    pass them, the slots' depth order fails them. The good shard's slots rise with depth on 96% of the rows
    (median cosines with the final state 0.86, 0.90, 0.92); reversed, on none."""
    model = sharp_model_dir
    good = probe_sampled(tmp_path, shard(tmp_path, "good", sampled_samples, model), model)
    assert good["aux_depth"]["layers"] == [2, 4, 5] and good["aux_depth"]["in_order_share"] > 0.9
    cosines = good["aux_depth"]["median_cosine_with_final"]
    assert cosines == sorted(cosines) and cosines[0] < 0.9
    reversed_dir = shard(tmp_path, "reversed", sampled_samples, model, capture_class=ReversedAuxCapture)
    with pytest.raises(ProbeFailure, match=r"rise in the order of their layers on 0\.0% of 192 rows") as failure:
        probe_sampled(tmp_path, reversed_dir, model)
    named = ", ".join(f"hidden_states[{layer}] {c:.3f}" for layer, c in zip([2, 4, 5], cosines[::-1], strict=True))
    assert f"median cosine of the slots index.json names {named}" in str(failure.value)
    assert "likelier from the final state" not in str(failure.value)  # the final slot passes
    # layers listed out of depth order, and stored as listed: the order is read from their numbers
    listed = probe_sampled(tmp_path, shard(tmp_path, "listed", sampled_samples, model, aux=[5, 2, 4]), model)
    assert listed["verdict"] != "fail" and listed["aux_depth"]["layers"] == [5, 2, 4]
    assert listed["aux_depth"]["in_order_share"] == good["aux_depth"]["in_order_share"]
    assert listed["aux_depth"]["median_cosine_with_final"] == [cosines[2], cosines[0], cosines[1]]
