"""The workflow end to end: the README's demo command, its outputs, reruns, profiles, config."""

import base64
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from eagle3_datagen import config_schema
from eagle3_datagen.chat.gates import GATES, console_line
from eagle3_datagen.formats.files import read_jsonl
from eagle3_datagen.formats.hidden_shard import HiddenShard
from eagle3_datagen.stages.tokens import loss_spans
from tests.doubles.loopback import Loopback, serve_in_thread
from tests.helpers import DEMO_CONSOLE, REPO, copy_workflow, run, scheduled, snakemake

pytestmark = pytest.mark.e2e

PARTITIONS = {"demo_sharegpt": 2, "demo_openai": 2, "demo_alpaca": 1}
# The demo's data curve: a draft per fraction of the samples below the whole (evaluate_point)
CURVE_POINTS = [f for f in yaml.safe_load((REPO / "config.yaml").read_text())["evaluate"]["fractions"] if f != 1]
SCHEMA = config_schema.SCHEMA_PATH


def shards(partition):
    return [f"{i:05d}" for i in range(PARTITIONS[partition])]


def test_demo_outputs_match_the_contract(demo_dir):
    for partition in PARTITIONS:
        stats = json.loads((demo_dir / f"results/{partition}/prompts/stats.json").read_text())
        prompt_ids = []
        for shard in shards(partition):
            prompts = read_jsonl(demo_dir / f"results/{partition}/prompts/{shard}.jsonl.zst")
            assert all(set(p) == {"id", "messages", "source"} for p in prompts)
            prompt_ids += [p["id"] for p in prompts]
            responses = read_jsonl(demo_dir / f"results/{partition}/responses/{shard}.jsonl.zst")
            assert [r["id"] for r in responses] == [p["id"] for p in prompts]  # each prompt exactly once
            for r in responses:
                assert r["backend"] == "hf" and r["status"] in ("ok", "truncated", "malformed")
                for m in r["messages"]:
                    if m["role"] == "assistant":
                        assert {"content", "reasoning", "finish_reason", "usage", "output_ids"} <= set(m)
            tokens = read_jsonl(demo_dir / f"results/{partition}/tokens/{shard}.jsonl.zst")
            assert all(set(t) == {"id", "input_ids", "loss_mask"} for t in tokens)
            assert all(len(t["input_ids"]) == len(t["loss_mask"]) and any(t["loss_mask"]) for t in tokens)
            audit = json.loads((demo_dir / f"results/{partition}/tokens/{shard}.audit.json").read_text())
            assert audit["counts"]["samples_out"] == len(tokens)
            assert audit["special_tokens"]["end_of_turn_id"] == 151645
            shard_dir = demo_dir / f"results/{partition}/hidden/{shard}"
            index = json.loads((shard_dir / "index.json").read_text())
            assert [f.name for f in sorted(shard_dir.glob("part-*.safetensors"))] == [p["file"] for p in index["parts"]]
            assert HiddenShard(shard_dir).ids == [t["id"] for t in tokens]
            assert index["tokens"] == sum(len(t["input_ids"]) for t in tokens)
            assert index["aux_layers"] == [2, 4, 5] and index["final"] == "raw" and index["dtype"] == "bfloat16"
        assert len(prompt_ids) == len(set(prompt_ids)) == stats["prompts"]
        summary = json.loads((demo_dir / f"results/report/{partition}.json").read_text())
        assert summary["prompts"]["prompts"] == stats["prompts"]
    sharegpt = json.loads((demo_dir / "results/report/demo_sharegpt.json").read_text())
    assert sharegpt["prompts"]["duplicates"] == 2 and sharegpt["prompts"]["skipped_no_user_turn"] == 1
    html = (demo_dir / "results/report/summary.html").read_text()
    assert all(p in html for p in PARTITIONS)


def test_demo_model_stops_and_the_audit_matches(demo_dir):
    for partition in PARTITIONS:
        summary = json.loads((demo_dir / f"results/report/{partition}.json").read_text())
        finish = summary["responses"]["finish_reasons"]
        assert finish.get("stop", 0) >= 0.8 * sum(finish.values())  # a fitted model, not random tokens
        assert summary["tokens"]["audit"]["semantic"] == 0


def test_each_gates_counts_reach_the_console_and_the_report(demo_dir):
    """Each tokens shard's gate counts on the console when it ends, and the partition's in its summary
    and the report's table. The demo model closes think blocks it never opened: those rows are malformed,
    their reasoning leaked into the content, and nothing else is dropped."""
    console = (demo_dir / DEMO_CONSOLE).read_text().splitlines()
    html = (demo_dir / "results/report/summary.html").read_text()
    dropped_in_demo = 0
    for partition in PARTITIONS:
        rows, dropped = 0, 0
        for shard in shards(partition):
            gates = json.loads((demo_dir / f"results/{partition}/tokens/{shard}.audit.json").read_text())["gates"]
            assert "note: " + console_line(f"{partition}/{shard}", gates) in console
            responses = read_jsonl(demo_dir / f"results/{partition}/responses/{shard}.jsonl.zst")
            malformed = {r["id"] for r in responses if r["status"] == "malformed"}
            assert gates["dropped"] == dict.fromkeys(malformed, ["reasoning_leak", "malformed"])
            rows, dropped = rows + gates["rows"], dropped + gates["dropped_rows"]
        summary = json.loads((demo_dir / f"results/report/{partition}.json").read_text())["gates"]
        assert (summary["rows"], summary["dropped_rows"]) == (rows, dropped)
        zero = dict.fromkeys([*GATES, "failed", "malformed"], 0)
        assert summary["counts"] == {**zero, "reasoning_leak": dropped, "malformed": dropped}
        share = f"{dropped / rows:.1%}"
        cells = [partition, rows, f"{dropped} ({share})", *["0 (0.0%)"] * 5, f"{dropped} ({share})", *["0 (0.0%)"] * 4]
        cells += ["0 (0.0%)", f"{dropped} ({share})"]
        assert "<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>" in html
        dropped_in_demo += dropped
    assert dropped_in_demo > 0


def test_hidden_states_equal_a_direct_transformers_forward(demo_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_dir / "results/demo/model").eval()
    checked = 0
    last_layer = {}
    model.model.layers[-1].register_forward_hook(lambda _m, _a, out: last_layer.update(out=out))
    for partition in PARTITIONS:
        shard = HiddenShard(demo_dir / f"results/{partition}/hidden/00000")
        tokens = {t["id"]: t for t in read_jsonl(demo_dir / f"results/{partition}/tokens/00000.jsonl.zst")}
        for stored in list(shard)[:4]:
            ids = tokens[stored["id"]]["input_ids"]
            assert stored["input_ids"].tolist() == ids
            assert stored["loss_mask"].tolist() == tokens[stored["id"]]["loss_mask"]
            with torch.no_grad():
                out = model(torch.tensor([ids]), output_hidden_states=True)
            layer_n = last_layer["out"][0] if isinstance(last_layer["out"], tuple) else last_layer["out"]
            final = layer_n[0]  # layer N's output, before the final norm (`final: raw`)
            aux = torch.cat([out.hidden_states[i][0] for i in (2, 4, 5)], dim=-1)
            # bf16 storage: 8 bits of mantissa
            torch.testing.assert_close(stored["aux_hidden_states"].float(), aux, atol=2e-2, rtol=1e-2)
            torch.testing.assert_close(stored["hidden_states"].float(), final, atol=2e-2, rtol=1e-2)
            checked += 1
    assert checked == 12


def test_loss_mask_decodes_to_the_assistant_turns(demo_dir):
    from eagle3_datagen.chat.template import load_tokenizer

    tokenizer = load_tokenizer(demo_dir / "results/demo/model")
    seen_multi_turn = seen_system = False
    for partition in PARTITIONS:
        for shard in shards(partition):
            responses = {r["id"]: r for r in read_jsonl(demo_dir / f"results/{partition}/responses/{shard}.jsonl.zst")}
            for sample in read_jsonl(demo_dir / f"results/{partition}/tokens/{shard}.jsonl.zst"):
                turns = [m for m in responses[sample["id"]]["messages"] if m["role"] == "assistant"]
                spans = loss_spans(sample["input_ids"], sample["loss_mask"])
                assert len(spans) == len(turns)
                # the last turn is trained on the exact generated IDs
                assert spans[-1] == turns[-1]["output_ids"]
                assert tokenizer.decode(spans[-1]).endswith(turns[-1]["content"] + "<|im_end|>")
                # earlier turns as the template renders them: content + end of turn
                for span, turn in zip(spans[:-1], turns[:-1], strict=True):
                    assert tokenizer.decode(span) == turn["content"] + "<|im_end|>"
                seen_multi_turn |= len(turns) > 1
                seen_system |= responses[sample["id"]]["messages"][0]["role"] == "system"
    assert seen_multi_turn and seen_system


def test_probe_finds_the_demo_shards_aligned(demo_dir):
    for partition, shards in PARTITIONS.items():
        probe = json.loads((demo_dir / f"results/report/{partition}.json").read_text())["probe"]
        assert probe["verdicts"] == {"ok": shards} and probe["greedy_exact"] is True
        assert probe["last_turn"]["top1_agreement"] >= 0.98
        assert probe["by_position"][0]["positions"] > 0
        shard = json.loads((demo_dir / f"results/{partition}/probe/00000.json").read_text())
        # the demo model ties its LM head to the embedding: those two tensors, nothing else
        assert shard["tensors_loaded"] == ["model.embed_tokens.weight", "model.norm.weight"]
    html = (demo_dir / "results/report/summary.html").read_text()
    assert "alt='probe agreement by position'" in html and "top-1 agreement, last turns" in html


def test_demo_writes_the_draft_vocabulary_and_both_exports(demo_dir):
    import numpy as np

    d2t, t2d = np.load(demo_dir / "results/vocab/d2t.npy"), np.load(demo_dir / "results/vocab/t2d.npy")
    assert d2t.shape == (256,) and t2d.shape == (151669,) and t2d.sum() == 256
    assert (np.arange(256) + d2t).tolist() == np.flatnonzero(t2d).tolist()
    vocab = json.loads((demo_dir / "results/vocab/vocab.json").read_text())
    assert 0.5 < vocab["coverage"] <= 1.0 and vocab["shards"] == sum(PARTITIONS.values())
    for partition in PARTITIONS:
        hidden = sum(len(HiddenShard(demo_dir / f"results/{partition}/hidden/{s}")) for s in shards(partition))
        for fmt in ("specforge", "speculators"):
            summary = json.loads((demo_dir / f"results/{partition}/export/{fmt}/export.json").read_text())
            assert summary["samples"] + summary["held_out"] == hidden  # the evaluation's held out
        final = HiddenShard(demo_dir / f"results/{partition}/hidden/{shards(partition)[0]}").index["final"]
        specforge = demo_dir / f"results/{partition}/export/specforge"
        assert json.loads((specforge / "export.json").read_text())["final_norm_applied"] is (final == "raw")
        assert json.loads((specforge / "draft_config.json").read_text())["draft_vocab_size"] == 256
        train = yaml.safe_load((specforge / "specforge.yaml").read_text())
        mapping = demo_dir.resolve() / "results/vocab/vocab_mapping.pt"
        assert train["model"]["vocab_mapping_path"] == str(mapping) and mapping.exists()  # named, not copied


def test_demo_holds_prompts_out_of_every_export_and_measures_a_draft_on_them(demo_dir):
    settings = yaml.safe_load((demo_dir / "config.yaml").read_text())["evaluate"]
    steps = 3  # evaluate.speculative.num_steps's default: at most 4 tokens a verify step
    all_held_out = []
    for partition in PARTITIONS:
        holdout = json.loads((demo_dir / f"results/{partition}/evaluate/holdout.json").read_text())
        held_out = holdout["ids"]
        assert len(held_out) == settings["holdout"] and holdout["prompts"] > len(held_out)
        hidden = [HiddenShard(demo_dir / f"results/{partition}/hidden/{shard}") for shard in shards(partition)]
        samples = [s for shard in hidden for s in shard]
        held_samples = [s["id"] for s in samples if s["id"] in held_out]
        for fmt in ("specforge", "speculators"):
            export = demo_dir / f"results/{partition}/export/{fmt}"
            exported = [json.loads(line)["id"] for line in (export / "ids.jsonl").read_text().splitlines()]
            assert not set(exported) & set(held_out)
            assert exported == [s["id"] for s in samples if s["id"] not in held_out]
            summary = json.loads((export / "export.json").read_text())
            assert summary["held_out"] == len(held_samples) and summary["samples"] + summary["held_out"] == len(samples)
        figures = json.loads((demo_dir / f"results/{partition}/evaluate/acceptance.json").read_text())
        assert figures["partition"] == partition and figures["prompts"] == len(held_samples) > 0
        assert [p["id"] for p in figures["per_prompt"]] == held_samples  # the held-out samples, in shard order
        value, (low, high) = figures["acceptance_length"], figures["interval_95"]
        assert 1.0 <= low <= value <= high <= steps + 1
        accepted = [a for p in figures["per_prompt"] for a in p["accepted"]]
        assert figures["verify_steps"] == len(accepted) and all(0 <= a <= steps for a in accepted)
        assert value == (sum(accepted) + len(accepted)) / len(accepted)  # committed tokens / verify steps
        assert len(figures["acceptance_by_position"]) == steps
        assert figures["trainer_estimate"]["estimated_by"].startswith("SpecForge 0.2.0's simulated_acc_len + 1")
        assert figures["settings"]["steps"] == settings["steps"]
        assert (demo_dir / f"results/{partition}/evaluate/draft/training_state.pt").is_file()
        all_held_out += held_samples
    together = json.loads((demo_dir / "results/evaluate/acceptance.json").read_text())
    assert together["partition"] == "all" and sorted(p["id"] for p in together["per_prompt"]) == sorted(all_held_out)
    assert 1.0 <= together["acceptance_length"] <= steps + 1
    # The data curve (evaluate.fractions: [0.5, 1.0]): each partition's draft and the mix's also on half the
    # samples (at least a batch), decoded on the same held-out prompts; the fit in curves.json, the report
    # and a line on the console.
    curves = {c["partition"]: c for c in json.loads((demo_dir / "results/report/curves.json").read_text())}
    assert sorted(curves) == sorted([*PARTITIONS, "all"])
    console = (demo_dir / DEMO_CONSOLE).read_text()
    for name, evaluate in [*((p, f"results/{p}/evaluate") for p in PARTITIONS), ("all", "results/evaluate")]:
        whole = json.loads((demo_dir / evaluate / "acceptance.json").read_text())
        half = json.loads((demo_dir / evaluate / "curve" / "0.5.json").read_text())
        assert [p["id"] for p in half["per_prompt"]] == [p["id"] for p in whole["per_prompt"]]
        assert half["fraction"] == 0.5 and half["samples"] == max(
            settings.get("batch_size", 4), round(whole["samples"] / 2)
        )
        points = curves[name]["curve"]["points"]
        assert [p["samples"] for p in points] == [half["samples"], whole["samples"]]
        assert [p["acceptance_length"] for p in points] == [half["acceptance_length"], whole["acceptance_length"]]
        assert curves[name]["line"] in console
    assert "How much data is enough" in (demo_dir / "results/report/summary.html").read_text()


def test_acceptance_below_the_minimum_fails_the_run_naming_it_and_keeps_the_data(demo_dir, tmp_path):
    """The quick fail through Snakemake, in a copy of the finished demo: a minimum just above what every
    partition's draft reached fails the run of demo_alpaca's evaluate job (the one job asked for: the
    others, which the new minimum reruns too, would each train a draft beside it, as would the data
    curve's points, to which no minimum applies), naming its partition and value; the hidden states and
    exports stay as they were."""
    work = tmp_path / "wf"
    shutil.copytree(demo_dir, work, symlinks=True)
    reached = {
        p: json.loads((work / f"results/{p}/evaluate/acceptance.json").read_text())["acceptance_length"]
        for p in PARTITIONS
    }
    reached["all"] = json.loads((work / "results/evaluate/acceptance.json").read_text())["acceptance_length"]
    config = yaml.safe_load((work / "config.yaml").read_text())
    config["evaluate"]["min_acceptance_length"] = round(max(reached.values()) + 0.01, 2)
    (work / "strict.yaml").write_text(yaml.safe_dump(config))
    data = sorted(p for p in (work / "results").rglob("*") if "/hidden/" in str(p) or "/export/" in str(p))
    before = {p: p.stat().st_mtime_ns for p in data if p.is_file()}
    target = "results/demo_alpaca/evaluate/acceptance.json"
    proc = snakemake([target, "--profile", "profiles/local", "--configfile", "strict.yaml"], work, check=False)
    assert proc.returncode != 0
    below = r"partition (\w+): acceptance length ([\d.]+) is below evaluate.min_acceptance_length"
    named = re.search(below, proc.stderr)
    assert named, proc.stderr[-3000:]
    partition, value = named.groups()
    assert partition == "demo_alpaca" and value == f"{reached[partition]:.3f}"  # the same draft: same data and seed
    assert "Common causes" in (work / f"logs/{partition}/evaluate/evaluate.log").read_text()
    assert {p: p.stat().st_mtime_ns for p in data if p.is_file()} == before  # the data stays, untouched


def embedded_pngs(html: str) -> dict[str, bytes]:
    """The report's images by alt text, decoded."""
    found = re.findall(r"<img class='plot' alt='([^']+)' src='data:image/png;base64,([^']+)'/>", html)
    return {alt: base64.b64decode(data) for alt, data in found}


def test_snakemake_report_builds_from_the_demo_run_with_its_plots(demo_dir, tmp_path):
    report = tmp_path / "report.html"
    snakemake(["--profile", "profiles/local", "--report", str(report)], demo_dir)
    summary = (demo_dir / "results/report/summary.html").read_text()
    # Snakemake's report embeds the summary page whole (base64 in its data).
    assert base64.b64encode(summary.encode()).decode()[:2000] in report.read_text(errors="replace")
    images = embedded_pngs(summary)
    assert set(images) == {
        "acceptance length per partition and by draft position",
        "length histograms",
        "outcomes",
        "throughput and bytes",  # nothing priced: no cost panel
        "probe agreement by position",
        # the alt text names each curve, in the legend's order (the demo keeps no baseline)
        "acceptance length against training samples: " + "; ".join([*sorted(PARTITIONS), "all"]),
    }
    for png in images.values():
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        width, height = struct.unpack(">II", png[16:24])
        assert width > 600 and height > 250
    for partition in PARTITIONS:
        summary = json.loads((demo_dir / f"results/report/{partition}.json").read_text())
        responses, tokens = summary["responses"], summary["tokens"]
        # Histograms count every regenerated turn and every sample exactly once.
        for name in ("prompt_tokens", "completion_tokens", "reasoning_chars"):
            assert sum(responses["lengths"][name].values()) == sum(responses["finish_reasons"].values())
        assert sum(tokens["lengths"]["sample_tokens"].values()) == tokens["samples_out"]
        bins = {int(k): v for k, v in tokens["lengths"]["sample_tokens"].items()}
        assert all(edge & (edge - 1) == 0 for edge in bins)  # powers of two (and 0)
        assert responses["throughput"]["completion_tokens"] == responses["usage"]["completion_tokens"]
        assert responses["throughput"]["completion_tokens_per_s"] > 0
        assert summary["hidden_states"]["throughput"]["tokens"] == summary["hidden_states"]["tokens"]


def test_reruns_schedule_only_what_a_change_invalidated(demo_dir, tmp_path):
    assert "Nothing to be done" in snakemake(["-n", "--profile", "profiles/local"], demo_dir).stdout
    config = yaml.safe_load((demo_dir / "config.yaml").read_text())
    config["partitions"]["demo_alpaca"]["system_prompt"] = "You are a different assistant."
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(config))
    out = snakemake(["-n", "--profile", "profiles/local", "--configfile", str(changed)], demo_dir).stdout
    jobs = scheduled(out)
    # each partition's draft trains with a draft vocabulary of its own data (evaluate_vocab): the other
    # partitions' evaluations stay; the combined vocabulary and the draft over all partitions rerun
    assert {p for _, p in jobs if p} == {"demo_alpaca"}, jobs
    assert ("evaluate", "demo_alpaca") in jobs and ("evaluate_vocab", "demo_alpaca") in jobs, jobs
    assert {r for r, _ in jobs} == {
        "prompts_demo_alpaca",
        "responses",
        "tokens",
        "hidden_states",
        "probe",
        "export",
        "vocab_mapping",
        "partition_summary",
        "summary",
        "all",
        "evaluate_holdout",
        "evaluate_vocab",
        "evaluate",
        "evaluate_all",
        *(("evaluate_point", "evaluate_point_all") if CURVE_POINTS else ()),
    }


@pytest.fixture(scope="module")
def production_dir(tmp_path_factory):
    work = copy_workflow(tmp_path_factory.mktemp("prod") / "wf")
    (work / "data/raw").mkdir(parents=True)
    for source in (
        "glaive-function-calling-v2.json",
        "magicoder-evol-instruct-110k.jsonl",
        "magicoder-oss-instruct-75k.jsonl",
    ):
        (work / "data/raw" / source).write_text("")
    return work


# Profiles by name (`--profile gpu`, found through the link in the working directory) and by path.
@pytest.mark.parametrize(
    ("profile", "config"),
    [
        ("gpu", "kimi-k2.5-sglang"),
        ("profiles/gpu", "kimi-k2.5-openrouter"),
        ("slurm", "kimi-k2.5-openrouter"),
        ("profiles/slurm", "kimi-k2.5-sglang"),
    ],
)
def test_production_configs_dry_run_under_profiles(production_dir, profile, config):
    proc = snakemake(["-n", "-p", "--profile", profile, "--configfile", f"config/{config}.yaml"], production_dir)
    assert f"Using profile {profile} for setting default command line arguments." in proc.stdout + proc.stderr
    out = proc.stdout
    jobs = scheduled(out)
    assert sum(r == "hidden_states" for r, _ in jobs) == 32
    # The hidden stage runs SGLang tensor parallel, one rank per GPU of the node, in the node's capture
    # runner (torchrun with the size from the run-only settings), so the job's command does not say it.
    assert out.count("python scripts/hidden_states.py") == 32
    blocks = {b.split(":", 1)[0].strip(): b for b in re.split(r"\n\s*rule ", out)[1:]}
    assert re.search(r"\bgpu=8\b", blocks["hidden_states"])
    # The GPU stages' shard jobs go to one group job per node (resources.nodes, 1 here): under SLURM one
    # allocation, one model load; a local run lists the groups but ignores them.
    assert out.count("Group job capture") == 1
    assert out.count("Group job generation") == (1 if "sglang" in config else 0)
    if "sglang" in config:  # the config launches the server: one job per shard, sharing the node's server
        assert sum(r == "responses_served" for r, _ in jobs) == 32
        responses = blocks["responses_served"]
        # On the node (the gpu profile's pool of 8) two shard jobs use the server at once
        # (launch.shard_jobs: 2), half the GPUs each; under SLURM a job is its whole node.
        gpus = 8 if "slurm" in profile else 4
        assert re.search(rf"\bgpu={gpus}\b", responses) and "slurm_partition=gpu" in responses
        assert re.search(r"\bmem_mb=512000\b", responses)
    else:
        assert sum(r == "responses" for r, _ in jobs) == 32
        assert re.search(r"\bgpu=0\b", blocks["responses"]) and "slurm_partition=cpu" in blocks["responses"]
    assert "slurm_partition=gpu" in blocks["hidden_states"]


# Runs Snakemake in a process whose boto3 talks to moto's in-process S3 (no network).
S3_DRIVER = """
import sys
import boto3
from moto import mock_aws
from snakemake.cli import main

with mock_aws():
    bucket = boto3.resource("s3", region_name="us-east-1").create_bucket(Bucket="eagle3-data")
    for key in sys.argv[2:]:
        bucket.put_object(Key=key, Body=b"")
    sys.argv = ["snakemake", *sys.argv[1].split()]
    main()
"""


def test_results_on_s3_through_the_storage_plugin_dry_run(production_dir):
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    prefix = "s3://eagle3-data/kimi-run"
    args = (
        "-n -p --profile profiles/slurm --configfile config/kimi-k2.5-openrouter.yaml "
        f"--default-storage-provider s3 --default-storage-prefix {prefix}"
    )
    raw = [
        f"kimi-run/data/raw/{name}"
        for name in (
            "glaive-function-calling-v2.json",
            "magicoder-evol-instruct-110k.jsonl",
            "magicoder-oss-instruct-75k.jsonl",
        )
    ]
    proc = run([sys.executable, "-c", S3_DRIVER, args, *raw], production_dir, env=env)
    out = proc.stdout
    jobs = scheduled(out)
    assert sum(r == "hidden_states" for r, _ in jobs) == 32 and sum(r.startswith("prompts_") for r, _ in jobs) == 3
    # Inputs come from the bucket, outputs go to it; jobs read and write a local staging copy.
    assert f"input: {prefix}/data/raw/glaive-function-calling-v2.json (retrieve from storage)" in out
    for output in ("prompts/00000.jsonl.zst", "responses/00000.jsonl.zst", "tokens/00000.jsonl.zst", "hidden/00000"):
        assert f"{prefix}/results/B1_glaive/{output} (send to storage)" in out
    staged = ".snakemake/storage/s3/eagle3-data/kimi-run"
    assert f"--source {staged}/data/raw/glaive-function-calling-v2.json" in out
    assert f"--out {staged}/results/B1_glaive/hidden/00000" in out


def test_switching_configs_reruns_what_combines_partitions_and_refuses_missing_sources(demo_dir, tmp_path):
    """After the demo: another config, a dropped partition, a source path with a typo."""
    assert "Nothing to be done" in snakemake(["-n", "--profile", "local"], demo_dir).stdout
    (demo_dir / "data/raw").mkdir(parents=True, exist_ok=True)
    for source in (
        "glaive-function-calling-v2.json",
        "magicoder-evol-instruct-110k.jsonl",
        "magicoder-oss-instruct-75k.jsonl",
    ):
        (demo_dir / "data/raw" / source).touch()
    out = snakemake(["-n", "-p", "--profile", "gpu", "--configfile", "config/kimi-k2.5-sglang.yaml"], demo_dir).stdout
    rules = [rule for rule, _ in scheduled(out)]
    assert "Nothing to be done" not in out
    assert rules.count("hidden_states") == 32 and {"summary", "vocab_mapping"} <= set(rules)
    # a group job's rules are indented under it (the gpu profile groups the capture jobs of a node)
    blocks = {b.split(":", 1)[0].strip(): b for b in re.split(r"\n\s*rule ", out)[1:]}
    assert re.search(r"\bgpu=8\b", blocks["hidden_states"])

    config = yaml.safe_load((demo_dir / "config.yaml").read_text())
    del config["partitions"]["demo_alpaca"]
    (tmp_path / "two.yaml").write_text(yaml.safe_dump(config))
    out = snakemake(["-n", "--profile", "local", "--configfile", str(tmp_path / "two.yaml")], demo_dir).stdout
    # The demo model is fitted on every partition, so more than these reruns; these must.
    assert {"summary", "vocab_mapping"} <= {rule for rule, _ in scheduled(out)}

    config["partitions"]["demo_openai"]["source"] = "resources/demo/data/opneai.jsonl"
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump(config))
    proc = snakemake(["-n", "--profile", "local", "--configfile", str(tmp_path / "typo.yaml")], demo_dir, check=False)
    assert proc.returncode != 0
    message = proc.stdout + proc.stderr
    assert "partition 'demo_openai': source 'resources/demo/data/opneai.jsonl' does not exist" in message
    assert str(tmp_path / "typo.yaml") in message
    assert "rule " not in proc.stdout


def test_bad_config_fails_before_any_job_naming_each_key(production_dir, tmp_path):
    """Four mistakes in one config (one Snakemake run): each is named with its key, none is echoed secret."""
    config = yaml.safe_load((REPO / "config" / "kimi-k2.5-openrouter.yaml").read_text())
    config["partitions"]["B1_glaive"].update(shards="two", format="vicuna")
    config["inference"]["openrouter"]["api_key"] = "sk-secret"
    config["hidden_states"]["shard_byte"] = 10
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config))
    proc = snakemake(["-n", "--configfile", str(bad)], production_dir, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "'two' is not of type 'integer'" in out
    assert "'vicuna' is not one of" in out
    assert "'api_key' was unexpected: did you mean 'api_key_env'?" in out
    assert "hidden_states: 'shard_byte' was unexpected: did you mean 'shard_bytes'?" in out
    assert "sk-secret" not in out
    assert "rule " not in proc.stdout


def test_openrouter_key_never_reaches_the_work_dir(demo_dir, tmp_path, monkeypatch):
    """A run whose demo_alpaca responses come from OpenRouter, less the evaluate jobs (the data curve's points
    too), the summary page that reads them and the draft vocabulary only they read (`--omit-from`): they
    train drafts with SpecForge and hold the key no more than every other job does (in the environment); the
    files they would write stay the demo's, scanned as well."""
    work = tmp_path / "wf"
    shutil.copytree(demo_dir, work, symlinks=True)
    marker = "sk-or-v1-MARKER-3d5e0c1b9f"
    monkeypatch.setenv("E3DG_MARKER_KEY", marker)
    server = Loopback("unused", api_key=marker)
    with serve_in_thread(server) as url:
        config = yaml.safe_load((work / "config.yaml").read_text())
        config["partitions"]["demo_alpaca"]["backend"] = "openrouter"
        config["inference"]["openrouter"] = {
            "base_url": url,
            "model": "moonshotai/kimi-k2.5",
            "api_key_env": "E3DG_MARKER_KEY",
            "reasoning": {"enabled": False},
        }
        # The stand-in answers "Reply to: ...", text the demo model cannot predict (its tokens are no likelier
        # from the states before them than from their neighbours): the probe's floor would stop the run.
        config["probe"]["min_aligned_best_share"] = 0.0
        (work / "openrouter.yaml").write_text(yaml.safe_dump(config))
        omit_drafts = [
            "--omit-from",
            "evaluate_vocab",
            "evaluate",
            "evaluate_all",
            "evaluate_point",
            "evaluate_point_all",
        ]
        snakemake(["--profile", "profiles/local", "--configfile", "openrouter.yaml", *omit_drafts], work)
    rows = read_jsonl(work / "results/demo_alpaca/responses/00000.jsonl.zst")
    assert {r["backend"] for r in rows} == {"openrouter"}
    assert sum(server.completed.values()) == len(rows) + 1  # and the canary, before the first job
    probe = json.loads((work / "results/demo_alpaca/probe/00000.json").read_text())
    assert probe["greedy_exact"] is False and probe["backend"] == "openrouter"
    scanned = 0
    for root, _dirs, files in os.walk(work, followlinks=False):
        for name in files:
            path = Path(root) / name
            if not path.is_symlink():
                assert marker.encode() not in path.read_bytes(), path
                scanned += 1
    assert scanned > 100 and (work / ".snakemake").is_dir()


def test_plan_counts_only_what_a_dry_run_would_regenerate(demo_dir, tmp_path):
    work = tmp_path / "wf"
    shutil.copytree(demo_dir, work, symlinks=True)
    plan = json.loads(run([sys.executable, "scripts/plan.py", "--json"], work).stdout)
    assert plan["partitions"] == [] and plan["total"]["prompts"] == 0
    config = yaml.safe_load((work / "config.yaml").read_text())
    config["partitions"]["demo_alpaca"].update(system_prompt="You are brief.", backend="openrouter")
    config["inference"]["openrouter"] = {"model": "m", "price_per_million": {"prompt": 0.6, "completion": 3.0}}
    config["plan"] = {"throughput": {"prefill_tokens_per_s": 1000}}
    (work / "changed.yaml").write_text(yaml.safe_dump(config))
    plan = json.loads(run([sys.executable, "scripts/plan.py", "--json", "--configfile", "changed.yaml"], work).stdout)
    [alpaca] = plan["partitions"]
    stats = json.loads((work / "results/demo_alpaca/prompts/stats.json").read_text())
    assert alpaca["partition"] == "demo_alpaca" and alpaca["prompts"] == stats["prompts"] == 26
    assert alpaca["completion_basis"].startswith("observed")
    expected_cost = alpaca["prompt_tokens"] / 1e6 * 0.6 + alpaca["completion_tokens"] / 1e6 * 3.0
    assert alpaca["cost_usd"] == pytest.approx(expected_cost)
    tokens = alpaca["prompt_tokens"] + alpaca["completion_tokens"]
    # 3 aux layers + final, hidden 64, bf16, uncompressed; index.json's ids and parts beside them
    assert alpaca["hidden_bytes"] == pytest.approx(tokens * ((3 + 1) * 64 * 2 + 5), rel=0.01)
    assert alpaca["disk"]["tokens_basis"].startswith("estimate") and alpaca["disk"]["shards_released"] is False
    assert set(alpaca["disk"]["export_bytes"]) == {"specforge", "speculators"}
    assert alpaca["disk"]["end_bytes"] == alpaca["disk"]["peak_bytes"]  # the demo keeps its shards
    assert alpaca["hidden_node_hours"] == pytest.approx(tokens / 1000 / 3600)  # the forward passes: the slower side
    assert alpaca["capture_rate"]["bound_by"] == "gpu" and plan["exceeds_free_disk"] is False
    # one hidden-state job, one capture load; no launched server in the demo
    assert plan["loads"]["capture_runner"]["loads"] == 1 and plan["loads"]["generation_server"]["loads"] == 0


def test_long_jobs_log_progress_as_plain_lines(demo_dir):
    for stage in ("tokens", "hidden"):
        for log in sorted(demo_dir.glob(f"logs/*/{stage}/*.log")):
            text = log.read_text()
            assert "progress: " in text and " ETA " in text and "\r" not in text, log


def status(work, *args, gates=False):
    """scripts/status.py's partitions; without `gates`, --no-gates: the responses' gated rows, which each call
    would count with the model's tokenizer loaded (5 of its 8 CPU seconds on the demo), are not what the test reads."""
    command = [sys.executable, "scripts/status.py", "--json", *args, *(() if gates else ("--no-gates",))]
    return json.loads(run(command, work).stdout)


# demo_alpaca's final outputs: the runs of the status test bring that partition up to date and train no
# other partition's draft (changing demo_alpaca's prompts changes the draft vocabulary every draft reads).
ALPACA_OUTPUTS = [
    "results/demo_alpaca/export/specforge",
    "results/demo_alpaca/export/speculators",
    "results/demo_alpaca/evaluate/acceptance.json",
    *(f"results/demo_alpaca/evaluate/curve/{f}.json" for f in CURVE_POINTS),
    "results/report/demo_alpaca.json",
]


def test_status_tells_complete_stale_running_and_failed(demo_dir, tmp_path):
    work = tmp_path / "wf"
    shutil.copytree(demo_dir, work, symlinks=True)
    assert {p: s["state"] for p, s in status(work, gates=True).items()} == dict.fromkeys(PARTITIONS, "complete")
    config = yaml.safe_load((work / "config.yaml").read_text())
    config["partitions"]["demo_alpaca"]["system_prompt"] = "You are brief."
    (work / "changed.yaml").write_text(yaml.safe_dump(config))
    changed = status(work, "--configfile", "changed.yaml")
    assert changed["demo_alpaca"]["state"] == "stale" and changed["demo_openai"]["state"] == "complete"
    assert "prompts_demo_alpaca: params changed" in changed["demo_alpaca"]["detail"]

    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # the jobs' python: the venv's, as in run()
    run_alpaca = [*ALPACA_OUTPUTS, "--profile", "profiles/local", "--configfile", "changed.yaml"]
    command = [str(Path(sys.executable).parent / "snakemake"), *run_alpaca]
    job = subprocess.Popen(command, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen = set()
    # until the run is seen running: each status call is a Snakemake run, which the run it watches waits on
    while job.poll() is None and "running" not in seen:
        seen.add(status(work, "--configfile", "changed.yaml")["demo_alpaca"]["state"])
        time.sleep(1)
    assert job.wait() == 0 and "running" in seen
    assert status(work, "--configfile", "changed.yaml")["demo_alpaca"]["state"] == "complete"

    shutil.rmtree(work / "results/demo_alpaca/hidden/00000")
    (work / "results/demo_alpaca/tokens/00000.jsonl.zst").write_bytes(b"not zstd")
    snakemake(run_alpaca, work, check=False)
    failed = status(work, "--configfile", "changed.yaml")["demo_alpaca"]
    assert failed["state"] == "failed" and "results/demo_alpaca/hidden/00000" in failed["detail"]
