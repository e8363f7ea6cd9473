"""The tiny Kimi target (config/tiny-kimi.yaml): DeepSeek-V3 with Kimi-K2.5's real tokenizer, end to end, through
the smoke run (`scripts/smoke.py`, docs/running.md): its one workflow run is every test's here."""

import json
import sys
import time

import numpy as np
import pytest
import torch
import yaml
from safetensors import safe_open

from eagle3_datagen.backends.hf.capture import HFCapture
from eagle3_datagen.backends.hf.generate import HFBackend
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.diagnostics import layer_check
from eagle3_datagen.formats.files import read_jsonl
from eagle3_datagen.formats.hidden_shard import HiddenShard, layer_tap_path
from eagle3_datagen.reporting.plan import measured_loads, plan_rates
from eagle3_datagen.stages.hidden.shard import capture_shard
from eagle3_datagen.stages.probe import ProbeFailure, ProbeSettings, run_probe
from eagle3_datagen.stages.responses.journaled import Budgets, run_journaled_responses
from eagle3_datagen.stages.tokens import TokenSettings, build_samples, loss_spans
from tests.helpers import KIMI_FILES, REPO, copy_workflow, run
from tests.helpers.captures import AuxOneLayerLateCapture, OffByOneCapture, ReversedAuxCapture
from tests.helpers.curves import curves_beside_baselines

pytestmark = pytest.mark.e2e

# Both partitions (the smoke run takes one per backend by default; both are hf here), one shard each.
PARTITIONS = {"tiny_chat": 1, "tiny_glaive": 1}
REASONING = "I will answer briefly."
SMOKE_LIMIT_S = 15 * 60


@pytest.fixture(scope="module")
def tiny_kimi_smoke(tmp_path_factory):
    """The workflow copied, and its smoke run on config/tiny-kimi.yaml on the CPU (model built and fitted,
    every stage, the layer check, the evaluate stage's draft, the measurements): the workflow's files, its
    output and how long it took."""
    work = copy_workflow(tmp_path_factory.mktemp("tiny-kimi") / "wf")
    command = [sys.executable, "scripts/smoke.py", "--configfile", "config/tiny-kimi.yaml"]
    # --baseline: the config's twins on the dataset's own responses, so the data curve has the baseline's beside it
    command += ["--profile", "profiles/local", "--partitions", *PARTITIONS, "--baseline"]
    started = time.monotonic()
    proc = run(command, work)
    return {"work": work, "out": proc.stdout, "seconds": time.monotonic() - started}


@pytest.fixture(scope="module")
def tiny_kimi_dir(tiny_kimi_smoke):
    """The smoke run's working directory: its results, logs and model."""
    return tiny_kimi_smoke["work"] / "smoke"


def test_the_smoke_run_passes_each_step_on_the_cpu_in_under_15_minutes(tiny_kimi_smoke):
    work, out = tiny_kimi_smoke["work"], tiny_kimi_smoke["out"]
    steps = {s["name"]: s for s in json.loads((work / "smoke/smoke.json").read_text())["steps"]}
    assert {name: s["status"] for name, s in steps.items()} == {
        "GPU check": "skip",  # no GPU here
        "workflow": "pass",
        "probe": "pass",
        "auxiliary layers": "pass",
        "draft": "pass",
        "measurements": "pass",
    }
    for name, s in steps.items():  # each step printed with its result and time as it ended, and in the table
        assert f"[smoke] {name}: {s['status'].upper()} ({s['seconds']:.1f} s)" in out
    assert "no GPU on this machine" in steps["GPU check"]["detail"]
    assert "SGLang's EAGLE3 cannot run on the CPU" in steps["draft"]["detail"]
    assert all(f"{p} top-1 1.0000 (greedy" in steps["probe"]["detail"] for p in PARTITIONS)
    assert "hidden_states[2], hidden_states[4], hidden_states[5] and the final" in steps["auxiliary layers"]["detail"]
    assert out.rstrip().endswith("passed")
    # announced before it starts: the steps, their model loads, their minutes; then measured beside the estimate
    assert out.startswith("smoke run, before it starts (each GPU step in a process of its own):")
    assert "loads: hf responses job (tiny_chat), hf responses job (tiny_glaive), capture runner;" in out
    assert "smoke run (measured; estimated before it started):" in out
    assert steps["auxiliary layers"]["seconds"] < 30  # it reads the capture runner's records: no model load
    assert tiny_kimi_smoke["seconds"] < SMOKE_LIMIT_S
    print(f"\nsmoke run on the tiny Kimi: {tiny_kimi_smoke['seconds']:.0f} s; " + ", ".join(
        f"{name} {s['seconds']} s" for name, s in steps.items()))  # fmt: skip


def test_the_plan_reads_the_smoke_runs_rates_and_loads(tiny_kimi_smoke):
    """Written where the plan reads them, for the model the week's run names (the demo's model path)."""
    work = tiny_kimi_smoke["work"]
    config = {"model": {"path": str(work / "results/tiny-kimi/model")}, "plan": {"throughput": {}}}
    rates = plan_rates(config, work / "logs")
    for key in ("generate_tokens_per_s", "prefill_tokens_per_s"):
        assert rates[key]["tokens_per_s"] > 0 and rates[key]["basis"].startswith("measured by the smoke run")
    smoke_index = json.loads((work / "smoke/results/tiny_chat/hidden/00000/index.json").read_text())
    assert smoke_index["throughput"]["tokens"] > 0
    # the capture runner's loads (the hf responses load in their jobs: no node service): at most one a capture
    # job, fewer where jobs shared it (each Snakemake call of the smoke run stops it at its end, and an idle
    # runner stops after hidden_states.runner.idle_timeout: a busy machine loads it more often)
    loads = measured_loads(work / "logs", "capture_runner", str((work / "results/tiny-kimi/model").resolve()))
    captures = list((work / "smoke/results").glob("*/hidden/[0-9][0-9][0-9][0-9][0-9]"))
    assert 1 <= len(loads) <= len(captures) and all(0 < seconds < 600 for seconds in loads), (loads, captures)


def test_the_layer_check_catches_reversed_auxiliary_layers_and_a_missing_final_norm(tiny_kimi_dir):
    """The capture runner's own records of every layer (4 samples a shard) against the stored slots pass; the
    same slots with the auxiliary layers reversed, or the SpecForge export's final state without its norm, fail,
    each named with the layer it holds (tests/workflow/test_planted_defect.py shows the probe passing reversed
    layers; tests/unit/test_layer_check.py plants the defects in the capture itself)."""
    shard_dir = tiny_kimi_dir / "results/tiny_glaive/hidden/00000"
    exports = {f: tiny_kimi_dir / f"results/tiny_glaive/export/{f}" for f in ("specforge", "speculators")}
    tap = layer_check.read_tap(layer_tap_path(shard_dir))
    assert len(tap) == 4 and layer_check.num_layers(tap) == 8
    assert layer_check.published_aux_layers(8) == [2, 4, 5]
    assert layer_check.published_aux_layers(61) == [2, 30, 58]  # Kimi-K2.5's
    stored = layer_check.stored_slots(shard_dir, exports, sorted(tap), [2, 4, 5])
    assert all(row.ok for row in layer_check.compare(tap, stored))
    reversed_aux = {
        sid: [(w, s, e, t) for (w, s, e, _), (*_, t) in zip(slots, [*slots[2::-1], *slots[3:]], strict=True)]
        for sid, slots in stored.items()
    }
    wrong = {(r.where, r.slot): r.best_match for r in layer_check.compare(tap, reversed_aux) if not r.ok}
    assert wrong == {("hidden shard", "aux 0"): "hidden_states[5]", ("hidden shard", "aux 2"): "hidden_states[2]"}
    raw_final = {}
    for sid, slots in stored.items():
        shard_final = next(t for w, s, e, t in slots if (w, s) == ("hidden shard", "final"))  # final: raw
        raw_final[sid] = [
            (w, s, e, shard_final if (w, s) == ("specforge export", "final") else t) for w, s, e, t in slots
        ]
    wrong = {(r.where, r.slot): r.best_match for r in layer_check.compare(tap, raw_final) if not r.ok}
    assert wrong == {("specforge export", "final"): "final, raw"}


def test_model_directory_is_a_kimi_one(tiny_kimi_dir):
    model = tiny_kimi_dir / "results/tiny-kimi/model"
    config = json.loads((model / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["vocab_size"] == 163840 and config["num_hidden_layers"] == 8
    assert config["rope_scaling"]["type"] == "yarn" and config["num_nextn_predict_layers"] == 0
    assert (config["n_group"], config["topk_group"], config["topk_method"], config["scoring_func"]) == (
        1,
        1,
        "noaux_tc",
        "sigmoid",
    )
    for name in ("tiktoken.model", "chat_template.jinja"):
        assert (model / name).read_bytes() == (KIMI_FILES / name).read_bytes()
    with safe_open(model / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
        assert weights.get_slice("lm_head.weight").get_shape() == [163840, 64]
    # Checkpoint names as DeepSeek-V3 and Kimi ship them: one tensor per expert, MLA projections.
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in names
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in names
    assert {"model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"} <= names
    from transformers import AutoConfig, AutoTokenizer

    loaded = AutoConfig.from_pretrained(model)
    assert loaded.rope_parameters["rope_type"] == "yarn" and loaded.rope_parameters["factor"] == 64.0
    assert AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("<|im_end|>") == 163586


def assistant_turns(work, partition):
    return [
        m
        for s in range(PARTITIONS[partition])
        for r in read_jsonl(work / f"results/{partition}/responses/{s:05d}.jsonl.zst")
        for m in r["messages"]
        if m["role"] == "assistant"
    ]


def test_greedy_generation_reasons_then_answers_as_fitted(tiny_kimi_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_kimi_dir / "results/tiny-kimi/model")
    chat = assistant_turns(tiny_kimi_dir, "tiny_chat")
    assert len(chat) == 14  # 12 conversations, two of them with a second user turn
    expected = {
        json.loads(line)["messages"][-1]["content"] for line in (REPO / "resources/tiny-kimi/data/chat.jsonl").open()
    }
    for turn in chat:
        assert turn["finish_reason"] == "stop" and turn["reasoning"] == REASONING and not turn.get("malformed")
        assert tokenizer.decode(turn["output_ids"]) == f"{REASONING}</think>{turn['content']}<|im_end|>"
    assert expected <= {t["content"] for t in chat}
    glaive = assistant_turns(tiny_kimi_dir, "tiny_glaive")
    assert all(t["reasoning"] == REASONING and not t.get("malformed") for t in glaive)
    assert [t["finish_reason"] for t in glaive if not t.get("tool_calls")] == ["stop"] * 6


def test_tool_prompts_get_kimi_tool_calls(tiny_kimi_dir):
    turns = assistant_turns(tiny_kimi_dir, "tiny_glaive")
    calls = [t for t in turns if t.get("tool_calls")]
    names = sorted(c["tool_calls"][0]["function"]["name"] for c in calls)
    assert names == ["calculate_square_root", "get_exchange_rate", "get_weather", "get_weather"]
    assert all(c["finish_reason"] == "tool_calls" and c["tool_calls"][0]["id"].startswith("functions.") for c in calls)
    # each matched call is followed by the recorded result and the fitted answer after it
    assert sum("degrees" in t["content"] for t in turns) == 2


def test_tokens_train_each_turn_as_the_model_emitted_it(tiny_kimi_dir):
    for partition, shards in PARTITIONS.items():
        for s in range(shards):
            responses = {
                r["id"]: r for r in read_jsonl(tiny_kimi_dir / f"results/{partition}/responses/{s:05d}.jsonl.zst")
            }
            samples = read_jsonl(tiny_kimi_dir / f"results/{partition}/tokens/{s:05d}.jsonl.zst")
            assert len(samples) >= len(responses) > 0
            for sample in samples:
                turns = [m for m in responses[sample["id"].split("#")[0]]["messages"] if m["role"] == "assistant"]
                assert loss_spans(sample["input_ids"], sample["loss_mask"])[-1] in [t["output_ids"] for t in turns]
            audit = json.loads((tiny_kimi_dir / f"results/{partition}/tokens/{s:05d}.audit.json").read_text())
            assert audit["special_tokens"]["end_of_turn_id"] == 163586


def test_hidden_states_probe_and_exports_on_the_kimi_architecture(tiny_kimi_dir):
    for partition, shards in PARTITIONS.items():
        tokens = read_jsonl(tiny_kimi_dir / f"results/{partition}/tokens/00000.jsonl.zst")
        shard_dir = tiny_kimi_dir / f"results/{partition}/hidden/00000"
        index = json.loads((shard_dir / "index.json").read_text())
        assert index["aux_layers"] == [2, 4, 5] and HiddenShard(shard_dir).ids == [t["id"] for t in tokens]
        first = next(iter(HiddenShard(shard_dir)))
        assert first["aux_hidden_states"].shape == (len(tokens[0]["input_ids"]), 3 * 64)
        probe = json.loads((tiny_kimi_dir / f"results/report/{partition}.json").read_text())["probe"]
        assert probe["verdicts"] == {"ok": shards} and probe["greedy_exact"] is True
        assert probe["last_turn"]["top1_agreement"] >= 0.98
        shard = json.loads((tiny_kimi_dir / f"results/{partition}/probe/00000.json").read_text())
        assert shard["tensors_loaded"] == ["lm_head.weight", "model.norm.weight"]  # Kimi's head is untied
        hidden = sum(len(HiddenShard(tiny_kimi_dir / f"results/{partition}/hidden/{s:05d}")) for s in range(shards))
        for fmt in ("specforge", "speculators"):
            summary = json.loads((tiny_kimi_dir / f"results/{partition}/export/{fmt}/export.json").read_text())
            assert summary["samples"] + summary["held_out"] == hidden and summary["held_out"] > 0
        # the evaluate stage on the Kimi architecture: a draft measured on the held-out samples
        figures = json.loads((tiny_kimi_dir / f"results/{partition}/evaluate/acceptance.json").read_text())
        assert figures["prompts"] == summary["held_out"] and 1.0 <= figures["acceptance_length"] <= 4.0
    together = json.loads((tiny_kimi_dir / "results/evaluate/acceptance.json").read_text())
    assert together["prompts"] == sum(
        json.loads((tiny_kimi_dir / f"results/{p}/evaluate/acceptance.json").read_text())["prompts"] for p in PARTITIONS
    )
    assert 1.0 <= together["acceptance_length"] <= 4.0
    d2t, t2d = np.load(tiny_kimi_dir / "results/vocab/d2t.npy"), np.load(tiny_kimi_dir / "results/vocab/t2d.npy")
    assert d2t.shape == (256,) and t2d.shape == (163840,) and t2d.sum() == 256
    assert (np.arange(256) + d2t).tolist() == np.flatnonzero(t2d).tolist()
    assert t2d[163586] and t2d[163607]  # <|im_end|> and </think> are drafted


def test_the_report_shows_each_data_curve_beside_the_baselines(tiny_kimi_dir):
    """evaluate.fractions [0.5, 1.0] with the baseline kept: every partition's and the mix's drafts at half and
    all of the samples, and the same drafts on the dataset's own responses, in curves.json, the report's
    verdicts, table and plot, and on the console (the workflow's log)."""
    fractions = yaml.safe_load((REPO / "config/tiny-kimi.yaml").read_text())["evaluate"]["fractions"]
    console = (tiny_kimi_dir / "workflow.log").read_text()
    curves = curves_beside_baselines(tiny_kimi_dir, [*PARTITIONS, "all"], fractions, console)
    print("\n" + "\n".join(c["line"] for c in curves.values()))


def test_hidden_states_equal_a_direct_transformers_forward(tiny_kimi_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_kimi_dir / "results/tiny-kimi/model").eval()
    stored = next(iter(HiddenShard(tiny_kimi_dir / "results/tiny_glaive/hidden/00000")))
    with torch.no_grad():
        out = model(stored["input_ids"][None].long(), output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i][0] for i in (2, 4, 5)], dim=-1)
    torch.testing.assert_close(stored["aux_hidden_states"].float(), aux, atol=2e-2, rtol=1e-2)


def test_its_answers_at_temperature_1_pass_the_alignment_floor_and_planted_defects_fail_it(tiny_kimi_dir, tmp_path):
    """The probe's hard floor on the tiny Kimi's own answers sampled at temperature 1 (to the smoke run's tiny_chat
    prompts, with its model): its fit counts the ~160k vocabulary rows it leaves untrained, so it samples the
    answers it learnt rather than them (docs/report.md). The tokens stage's gates drop none, and the hf capture's
    shard passes the floor; stored one row early it fails it, its raw final slot said normed fails the norm
    check, and its auxiliary layers reversed fail the slots' depth order. Each slot one layer late keeps that
    order and passes the probe: the layer check catches it (tests/unit/test_layer_check.py)."""
    config = fill_defaults(yaml.safe_load((REPO / "config/tiny-kimi.yaml").read_text()))
    model_dir, floor = tiny_kimi_dir / "results/tiny-kimi/model", config["probe"]["min_aligned_best_share"]
    sampling = {**config["inference"]["sampling"], "temperature": 1.0}
    backend = HFBackend(model_dir, sampling, config["inference"]["hf"], config["model"])
    prompts = tiny_kimi_dir / "results/tiny_chat/prompts/00000.jsonl.zst"
    run_journaled_responses(prompts, tmp_path / "rows.jsonl.zst", tmp_path / "stats.json", backend, Budgets())
    rows = read_jsonl(tmp_path / "rows.jsonl.zst")
    samples, audit = build_samples(rows, model_dir, config["model"], TokenSettings.from_config(config["tokens"]))
    assert len(rows) == len(read_jsonl(prompts)) >= 4 and len(samples) >= len(rows)
    assert (audit["gates"]["dropped_rows"], audit["audit"]["semantic"]) == (0, 0)

    def probed(name, capture_class=HFCapture, says=None):
        capture = capture_class(model_dir, "auto", "raw", {"dtype": "float32", "device": "cpu"})
        capture_shard(samples, tmp_path / name, capture, {**config["hidden_states"], "dtype": "float32"})
        if says:  # index.json names the other final slot than the capture stored
            index = json.loads((tmp_path / name / "index.json").read_text())
            (tmp_path / name / "index.json").write_text(json.dumps({**index, "final": says}))
        settings = ProbeSettings.from_config(config["probe"])
        return run_probe(
            tmp_path / name, tmp_path / f"{name}.json", model_dir, settings, "tiny_chat", "hf", False, audit
        )

    good = probed("good")
    print(f"\ntiny Kimi at temperature 1: {good['alignment']}, {good['aux_depth']}")
    assert good["verdict"] == "ok" and good["greedy_exact"] is False and good["alignment"]["positions"] > 50
    assert good["alignment"]["aligned_best_share"] >= max(floor, 0.9) and good["alignment"]["margin"] > 8.0
    assert good["all"]["mean_logprob"] > -2.0  # a quarter to a third of the mass before its fit counted the rest
    with pytest.raises(ProbeFailure, match=r"shard early \(hf\): [0-9.]+% of the stored tokens") as failure:
        probed("early", OffByOneCapture)
    assert float(str(failure.value).split("): ")[1].split("%")[0]) / 100 < 0.1
    # a raw row now and then has an RMS over the norm's weight near 1 (1.8% of the rows here): the slot still reads raw
    says = r"index.json says the final slot is normed, but [0-9.]+% of the probed rows .* the slot holds raw states"
    with pytest.raises(ProbeFailure, match=says):
        probed("raw_said_normed", says="normed")
    # its slots rise with depth on every row measured (164; medians 0.945, 0.984, 0.989), reversed on none
    assert good["aux_depth"]["layers"] == [2, 4, 5] and good["aux_depth"]["in_order_share"] >= 0.9
    with pytest.raises(ProbeFailure, match=r"shard reversed \(hf\): the auxiliary slots' cosines .* on 0\.0% of"):
        probed("reversed", ReversedAuxCapture)
    one_late = probed("aux_one_late", AuxOneLayerLateCapture)  # 0.994 measured: the order holds
    assert one_late["verdict"] == "ok" and one_late["aux_depth"]["in_order_share"] >= 0.9
