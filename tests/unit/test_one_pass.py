"""vLLM's one pass without vLLM: what validation refuses, the settings that reach the jobs, and staging and
packing of files in the format vLLM 0.32.0's hidden-states connector writes (`hidden_states` [T, layers, H],
`token_ids` [T], a `.lock` beside). tests/real_vllm/test_server.py runs it against vLLM's own server."""

import copy
import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from eagle3_datagen.backends.plugins import GENERATION
from eagle3_datagen.backends.vllm.one_pass import (
    StagedStates,
    StagedStatesError,
    launch_args_for,
    stage_states,
    states_dir,
)
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.formats.files import write_jsonl_zst
from eagle3_datagen.formats.hidden_shard import HiddenShard
from eagle3_datagen.stages.hidden.one_pass import pack_states
from eagle3_datagen.workflow import settings as wf
from eagle3_datagen.workflow.config_checks import one_pass_problems
from tests.helpers import HIDDEN_SETTINGS, REPO

LAYERS, WIDTH = 4, 8
AUX = [1, 2, 3]


def one_pass_config(**hidden) -> dict:
    config = fill_defaults(yaml.safe_load((REPO / "config.yaml").read_text()))
    config["inference"]["backend"] = "vllm"
    config["inference"]["vllm"] = fill_defaults({"launch": {"args": ["--dtype", "float32"]}}, "inference.vllm")
    config["inference"]["sampling"].update(temperature=0.0, seed=None)
    config["hidden_states"].update(one_pass=True, final="raw", layer_check_samples=0, **hidden)
    return config


def test_validation_refuses_what_one_pass_cannot_serve():
    config = one_pass_config()
    assert one_pass_problems(config) == []
    assert one_pass_problems({**config, "hidden_states": {**config["hidden_states"], "one_pass": False}}) == []

    def problems(change) -> list[str]:
        changed = copy.deepcopy(config)
        change(changed)
        return one_pass_problems(changed)

    seeded = problems(lambda c: c["inference"]["sampling"].update(temperature=0.7, seed=3))
    assert len(seeded) == 1 and "seeded sampling (temperature 0.7, seed 3)" in seeded[0]
    # unseeded sampling, or a seed under greedy decoding (never sent), is served
    assert problems(lambda c: c["inference"]["sampling"].update(temperature=0.7)) == []
    assert problems(lambda c: c["inference"]["sampling"].update(seed=3)) == []
    at_url = problems(lambda c: c["inference"]["vllm"].pop("launch"))
    assert len(at_url) == 1 and "inference.vllm.launch" in at_url[0]
    caching = problems(lambda c: c["inference"]["vllm"]["launch"]["args"].append("--enable-prefix-caching"))
    assert len(caching) == 1 and "sets --enable-prefix-caching" in caching[0]
    normed = problems(lambda c: c["hidden_states"].update(final="normed", layer_check_samples=2))
    assert len(normed) == 2 and "final: raw" in normed[0] and "layer_check_samples: 0" in normed[1]
    no_vllm = problems(lambda c: c["inference"].update(backend="sglang"))
    assert no_vllm == ["hidden_states.one_pass: no partition is answered by inference backend vllm; set it false"]


def test_the_vllm_partitions_jobs_carry_one_pass_and_their_server_the_extraction_flags(tmp_path):
    config = one_pass_config(aux_layers=AUX)
    settings = wf.response_settings(config, "demo_sharegpt")
    assert settings["vllm"]["one_pass"] == {"aux_layers": AUX, "storage": "results/.one_pass"}
    assert wf.one_pass_states(config, "demo_sharegpt") == "results/demo_sharegpt/responses/{shard}.states"
    off = {**config, "hidden_states": {**config["hidden_states"], "one_pass": False}}
    assert "one_pass" not in wf.response_settings(off, "demo_sharegpt")["vllm"]
    assert wf.one_pass_states(off, "demo_sharegpt") is None
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": LAYERS, "hidden_size": WIDTH}))
    settings["model"]["path"] = str(tmp_path)
    flags = launch_args_for(settings)
    assert flags[0] == "--no-enable-prefix-caching"
    speculative = json.loads(flags[flags.index("--speculative-config") + 1])
    assert speculative["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [*AUX, LAYERS]
    transfer = json.loads(flags[flags.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector_extra_config"]["shared_storage_path"].endswith("/results/.one_pass")
    job = wf.merged(settings, wf.response_run_settings(config))  # as the rule hands them to the job
    service = GENERATION["vllm"].launched_service(job, None)
    assert service.command[-len(flags) :] == flags and "--dtype" in service.command


def server_file(folder, name, ids, seed) -> tuple[str, torch.Tensor]:
    """A request's file as vLLM's connector leaves it: the states of `ids`, and its lock."""
    states = torch.randn(len(ids), len(AUX) + 1, WIDTH, generator=torch.Generator().manual_seed(seed))
    path = folder / f"{name}.safetensors"
    save_file({"hidden_states": states, "token_ids": torch.tensor(ids)}, str(path))
    (folder / f"{name}.safetensors.lock").touch()
    return str(path), states


def answered(row_id, turns) -> dict:
    """A responses row of `turns`: (output ids, states path)."""
    messages = [{"role": "user", "content": "hi"}]
    for output, path in turns:
        messages.append({"role": "assistant", "output_ids": output, "produced_by": {"states_path": path}})
        messages.append({"role": "user", "content": "more"})
    return {"id": row_id, "messages": messages[:-1]}


@pytest.fixture
def staged(tmp_path):
    """A shard of two conversations staged: one of one turn, one of two; and their token rows."""
    server = tmp_path / "server"
    server.mkdir()
    first, first_states = server_file(server, "r1", [5, 6, 7, 40, 41], seed=1)
    earlier, _ = server_file(server, "r2", [5, 8, 50], seed=2)
    last, last_states = server_file(server, "r3", [5, 8, 50, 51, 9, 60, 61, 62], seed=3)
    rows = [answered("a", [([40, 41, 2], first)]), answered("b", [([50, 51], earlier), ([60, 61, 62, 2], last)])]
    out = tmp_path / "responses" / "00000.jsonl.zst"
    out.parent.mkdir()
    index = stage_states(rows, out)
    tokens = [
        # the template's rendering: the states' ids, the last generated id, what the template adds after it
        {"id": "a", "input_ids": [5, 6, 7, 40, 41, 2, 77], "loss_mask": [0, 0, 0, 1, 1, 1, 0]},
        {"id": "b", "input_ids": [5, 8, 50, 51, 9, 60, 61, 62, 2], "loss_mask": [0, 0, 1, 1, 0, 1, 1, 1, 1]},
    ]
    return out, index, tokens, {"a": first_states, "b": last_states}, server


def test_staging_keeps_each_conversations_last_turn_and_removes_the_rest(staged):
    out, index, _, _, server = staged
    assert index == {"a": "000000.safetensors", "b": "000001.safetensors"}
    assert sorted(p.name for p in states_dir(out).iterdir()) == [
        "000000.safetensors",
        "000001.safetensors",
        "index.json",
    ]
    assert list(server.iterdir()) == []  # moved or removed, locks too


def test_packing_writes_the_states_for_the_servers_ids_with_the_rows_cut_to_them(staged, tmp_path):
    out, _, tokens, states, _ = staged
    write_jsonl_zst(tmp_path / "tokens.jsonl.zst", tokens)
    (tmp_path / "model").mkdir()
    (tmp_path / "model/config.json").write_text(json.dumps({"num_hidden_layers": LAYERS, "hidden_size": WIDTH}))
    hidden = {**HIDDEN_SETTINGS, "aux_layers": AUX}
    index = pack_states(
        tmp_path / "tokens.jsonl.zst", states_dir(out), tmp_path / "shard", hidden, {"path": str(tmp_path / "model")}
    )
    assert (index["samples"], index["tokens"], index["loss_tokens"], index["final"]) == (2, 13, 2 + 5, "raw")
    stored = {row["id"]: row for row in HiddenShard(tmp_path / "shard")}
    assert stored["a"]["input_ids"].tolist() == [5, 6, 7, 40, 41]
    assert stored["b"]["loss_mask"].tolist() == [0, 0, 1, 1, 0, 1, 1, 1]
    for row_id, expected in states.items():
        assert torch.equal(stored[row_id]["aux_hidden_states"], expected[:, :-1].reshape(len(expected), -1))
        assert torch.equal(stored[row_id]["hidden_states"], expected[:, -1])
    assert not states_dir(out).exists()  # the shard is the one copy


def test_a_row_whose_ids_do_not_start_with_the_states_ids_fails_the_job(staged, tmp_path):
    out, _, tokens, _, _ = staged
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": LAYERS, "hidden_size": WIDTH}))
    tokens[1]["input_ids"][4] = 10  # the template rendered the history other than the server read it
    with pytest.raises(StagedStatesError, match=r"'b'.*first difference at 4"):
        StagedStates(states_dir(out), tmp_path, AUX).samples(tokens)


def test_staging_refuses_states_of_other_ids_than_the_turn_generated(tmp_path):
    path, _ = server_file(tmp_path, "r1", [5, 6, 7, 40, 41], seed=1)
    with pytest.raises(StagedStatesError, match="do not end with the 2 it generated"):
        stage_states([answered("a", [([40, 42, 2], path)])], tmp_path / "00000.jsonl.zst")


def test_the_plan_shows_the_prefill_one_pass_saves_and_the_staged_states_disk(tmp_path):
    from eagle3_datagen.reporting.plan import ScheduledJob, _one_pass_lines, plan_loads, plan_partition, plan_tokenizer

    config = one_pass_config(aux_layers=AUX)
    config["inference"]["vllm"]["launch"]["args"] = ["--dtype", "float32"]
    config["plan"]["throughput"] = {"prefill_tokens_per_s": 1000.0}
    messages = [{"role": "user", "content": "Tell me about lakes."}]
    for partition in ("demo_sharegpt", "demo_openai"):
        for shard in range(config["partitions"][partition]["shards"]):
            path = tmp_path / partition / "prompts" / f"{shard:05d}.jsonl.zst"
            write_jsonl_zst(path, [{"id": f"{shard}", "messages": messages, "source": "t"}])
    config["partitions"]["demo_openai"]["backend"] = "sglang"  # captured as before
    tokenizer = plan_tokenizer(config)
    one_pass = plan_partition(config, "demo_sharegpt", tokenizer, tmp_path)
    captured = plan_partition(config, "demo_openai", tokenizer, tmp_path)
    assert captured.one_pass is None
    assert {**one_pass.disk, "partition": ""} == {**captured.disk, "partition": ""}  # the same shards either way
    tokens = one_pass.disk["tokens"]
    hidden = config["demo"]["hidden_size"]
    assert one_pass.one_pass == {
        "prefill_node_hours_saved": pytest.approx(tokens / 1000.0 / 3600),
        "staged_bytes": tokens * (len(AUX) + 1) * hidden * 4,  # float32: the server's --dtype
    }
    assert one_pass.hidden_node_hours == pytest.approx(tokens / one_pass.capture_rate["cpu_tokens_per_s"] / 3600)
    jobs = [ScheduledJob("hidden_states", p, None) for p in ("demo_sharegpt", "demo_openai")]
    assert plan_loads(config, jobs[:1], tmp_path)["capture_runner"]["loads"] == 0  # packing loads no model
    assert plan_loads(config, jobs, tmp_path)["capture_runner"]["loads"] == 1
    said = _one_pass_lines({"partitions": [asdict(one_pass), asdict(captured)]})
    assert len(said) == 1 and said[0].startswith("\none pass (hidden_states.one_pass): demo_sharegpt save")
    assert f"saving a prefill of {tokens / 1000.0 / 3600:.2f} node-h" in said[0]


def test_staging_waits_for_a_file_the_server_is_still_writing(tmp_path):
    """The server answers before its writer thread writes the file; the lock, held exclusively from the
    request's scheduling until the file is written, is what staging waits on."""
    import fcntl
    import os
    import threading
    import time

    path = tmp_path / "r1.safetensors"
    lock_fd = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)

    def write_later():
        time.sleep(0.5)
        save_file(
            {"hidden_states": torch.zeros(5, len(AUX) + 1, WIDTH), "token_ids": torch.tensor([5, 6, 7, 40, 41])},
            str(path),
        )
        os.close(lock_fd)

    writer = threading.Thread(target=write_later)
    writer.start()
    index = stage_states([answered("a", [([40, 41, 2], str(path))])], tmp_path / "00000.jsonl.zst")
    writer.join()
    assert index == {"a": "000000.safetensors"} and not path.exists() and not Path(f"{path}.lock").exists()


def test_a_one_token_answer_stages_the_prompts_states(tmp_path):
    path, _ = server_file(tmp_path, "r1", [5, 6, 7], seed=1)
    assert stage_states([answered("a", [([2], path)])], tmp_path / "00000.jsonl.zst") == {"a": "000000.safetensors"}


def test_the_disk_check_counts_the_states_a_one_pass_run_stages(tmp_path):
    """A one-pass partition's responses jobs stage its states ((aux + 1) x hidden at the server's dtype a token)
    until its shards are packed: the disk check before the first job counts them with the shards and exports.
    Under a quota that holds the shards and exports but not the staged states, the run is refused, saying so;
    the same partition captured by a separate prefill fits."""
    from eagle3_datagen.backends.plugins import SERVED_RESPONSE_RULE
    from eagle3_datagen.workflow import disk
    from eagle3_datagen.workflow.preflight import Job, problems

    config = one_pass_config(aux_layers=AUX)
    partition = "demo_sharegpt"
    results = tmp_path / "results"
    shards = config["partitions"][partition]["shards"]
    tokens = 10**6
    for shard in range(shards):
        audit = results / partition / "tokens" / f"{shard:05d}.audit.json"
        audit.parent.mkdir(parents=True, exist_ok=True)
        audit.write_text(json.dumps({"counts": {"tokens": tokens // shards, "samples_out": 100}}))
    measured = disk.measured_tokens(config, partition, results)
    assert measured.tokens == tokens
    counted = disk.partition_bytes(config, partition, measured, results)
    staged = tokens * (len(AUX) + 1) * config["demo"]["hidden_size"] * 4  # float32: the server's --dtype
    assert disk.staged_bytes_per_token(config, disk.stored_states(config)) * tokens == staged
    jobs = [Job(SERVED_RESPONSE_RULE, partition), Job("hidden_states", partition), Job("export", partition)]
    config["resources"]["disk_quota_bytes"] = counted.peak + staged // 2

    def disk_problems(config) -> list[str]:
        found = problems(config, jobs, {"PATH": str(Path(sys.executable).parent)}, False, results)
        return [p for p in found if p.startswith("the hidden-state shards and exports")]

    (refused,) = disk_problems(config)
    needed = counted.shards + sum(counted.exports.values()) + staged
    assert refused.startswith(
        f"the hidden-state shards and exports of {partition} (with the states their one-pass responses stage) "
        f"need up to {needed / 2**30:,.1f} GiB at once (measured (token shards))"
    )
    config["hidden_states"]["one_pass"] = False
    assert disk_problems(config) == []
