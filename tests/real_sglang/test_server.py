"""The `sglang` responses backend against a real `sglang.launch_server` (0.5.23, CPU, float32).

One server serves the whole module, with the flags the node's shared server takes (--skip-tokenizer-init
after the CPU's); it is started by `launched_server` (as the GPU check starts one) inside a job process,
and stopped at the end by SIGTERM to that job.
"""

import json
import signal
import subprocess
import sys
import urllib.request

import pytest

from eagle3_datagen.backends.service.record import pid_alive
from eagle3_datagen.backends.sglang.generate import SKIP_TOKENIZER, SGLangBackend
from eagle3_datagen.chat.template import load_tokenizer, render_ids
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.formats.files import read_jsonl, write_jsonl_zst
from eagle3_datagen.stages.responses.journaled import Budgets, run_journaled_responses
from tests.helpers import free_port, wait_until
from tests.helpers.sglang_cpu import CPU_LAUNCH_ARGS, greedy

JOB = """
import sys, time
from eagle3_datagen.backends.sglang.server import launched_server
from eagle3_datagen.config_schema import fill_defaults
launch = fill_defaults({"args": %r, "health_timeout": 900}, "inference.sglang.launch")
with launched_server(%r, %r, launch, %r) as server:
    print(server.pid, flush=True)
    time.sleep(3600)
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory, served_model_dir):
    """(url, server pid) of a real SGLang server with the node's server's flags (no tokenizer: the backend sends
    input_ids, reads output_ids); on teardown, SIGTERM to its job stops it."""
    url = f"http://127.0.0.1:{free_port()}"
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = [*CPU_LAUNCH_ARGS, SKIP_TOKENIZER]
    job = subprocess.Popen(
        [sys.executable, "-c", JOB % (args, str(served_model_dir), url, str(log))],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = job.stdout.readline()
    if not line:
        pytest.fail(f"the SGLang server did not start:\n{log.read_text()[-3000:]}")
    server_pid = int(line)
    yield url, server_pid
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=120) != 0
    assert wait_until(lambda: not pid_alive(server_pid), timeout=60), "the SGLang server outlived its job's SIGTERM"


def post(url, path, payload=None):
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def test_model_info_names_model_path(server, served_model_dir):
    url, _ = server
    assert post(url, "/model_info")["model_path"] == str(served_model_dir)


def test_responses_are_hf_greedy_ids_through_both_tiers(server, served_model_dir, hf_model, tmp_path):
    url, _ = server
    prompts = [
        {"id": f"p{i}", "source": "test", "messages": [{"role": "user", "content": text}]}
        for i, text in enumerate(["Hi.", "Tell me a long story about a dragon who lived in the mountains near a lake."])
    ]
    write_jsonl_zst(tmp_path / "prompts.jsonl.zst", prompts)
    tiers = {
        "short": {"max_prompt_tokens": 12, "concurrency": 2, "max_tokens": 6},
        "long": {"concurrency": 1, "max_tokens": 3},
    }
    backend = SGLangBackend(
        served_model_dir,
        fill_defaults({"max_new_tokens": 6, "temperature": 0.0}, "inference.sampling"),
        fill_defaults({"url": url, "tiers": tiers}, "inference.sglang"),
        fill_defaults({}, "model"),
    )
    run_journaled_responses(
        tmp_path / "prompts.jsonl.zst", tmp_path / "out.jsonl.zst", tmp_path / "s.json", backend, Budgets()
    )
    tokenizer = load_tokenizer(served_model_dir)
    turns = {}
    for row in read_jsonl(tmp_path / "out.jsonl.zst"):
        [turn] = [m for m in row["messages"] if m["role"] == "assistant"]
        turns[row["id"]] = turn
    for prompt in prompts:
        turn = turns[prompt["id"]]
        prompt_ids = render_ids(tokenizer, prompt["messages"], True, {})
        tier = "short" if len(prompt_ids) <= 12 else "long"
        assert turn["produced_by"]["tier"] == tier
        assert turn["output_ids"] == greedy(hf_model, prompt_ids, tiers[tier]["max_tokens"])
        assert turn["finish_reason"] == "length"
        assert turn["produced_by"]["finish_reason"]["type"] == "length"
    assert {t["produced_by"]["tier"] for t in turns.values()} == {"short", "long"}


def test_a_stop_id_ends_generation_with_the_matched_id_kept(server):
    """The stop id is taken from the server's own greedy output: a random tiny model's top two
    logits can be close enough that transformers' greedy path differs from SGLang's."""
    url, _ = server
    prompt_ids = [9707, 11, 1879, 0, 42]
    sampling = {"max_new_tokens": 8, "temperature": 0.0}
    free = post(url, "/generate", {"input_ids": prompt_ids, "sampling_params": sampling})
    assert free["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    stop = free["output_ids"][3]
    stopped = post(
        url,
        "/generate",
        {"input_ids": prompt_ids, "sampling_params": {**sampling, "stop_token_ids": [stop], "no_stop_trim": True}},
    )
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stopped["output_ids"] == free["output_ids"][: free["output_ids"].index(stop) + 1]


def test_gpu_checks_generate_comparison_agrees_with_the_server(server, served_model_dir):
    from eagle3_datagen.diagnostics.gpu_check import generate_agreement

    url, _ = server
    result = generate_agreement(
        url, served_model_dir, [[9707, 11, 1879], [40, 1079, 264, 3460, 13]], 5, {"dtype": "float32", "device": "cpu"}
    )
    assert (result.prompts, result.exact, result.first_token, result.ok) == (2, 2, 2, True)
    assert result.row().endswith("ok")


def test_sglangs_own_parser_takes_the_evaluate_stages_eagle3_flags():
    """The GPU path's launch flags (stages/evaluate/serving.py) as SGLang 0.5.23's ServerArgs parses them."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    from eagle3_datagen.config_schema import fill_defaults
    from eagle3_datagen.stages.evaluate.serving import eagle3_launch_args

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    speculative = fill_defaults({}, "evaluate")["speculative"]
    args = parser.parse_args(["--model-path", "target", *eagle3_launch_args("draft", speculative)])
    assert (args.speculative_algorithm, args.speculative_draft_model_path) == ("EAGLE3", "draft")
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (3, 1, 4)
