"""The GPU path (not run here: no GPU): SGLang 0.5.23 serving the target with the trained draft (EAGLE3),
each held-out prompt decoded greedily through `/generate`, and the acceptance length read from SGLang's own
per-request figures (`scripts/serve_draft.py`, which the smoke run calls on a GPU node).

The launch flags are `ServerArgs` fields of SGLang 0.5.23 (checked against its own parser: tests/real_sglang).
Each response's `meta_info` carries `spec_verify_ct` (verify steps) and `completion_tokens`; SGLang's
`spec_accept_length` is their ratio (`TokenizerManager`: completion tokens / verify steps, the bonus token
included, and the prefill's first token, which the CPU path leaves out). Summed over the held-out prompts
it is the figure the CPU path measures (speculative.py: `acceptance_length`), up to that first token.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path


def eagle3_launch_args(draft_path: str, speculative: dict) -> list[str]:
    """SGLang's launch_server flags for EAGLE3 with `draft_path` (a draft in SGLang's layout) and the
    `evaluate.speculative` settings."""
    return [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        str(draft_path),
        "--speculative-num-steps",
        str(speculative["num_steps"]),
        "--speculative-eagle-topk",
        str(speculative["topk"]),
        "--speculative-num-draft-tokens",
        str(speculative["num_draft_tokens"]),
    ]


def sglang_acceptance(meta_infos: list[dict]) -> dict:
    """The server-wide acceptance length over responses' `meta_info`s: summed completion tokens by summed
    `spec_verify_ct`, and each response's own `spec_accept_length` beside it."""
    verify = sum(m["spec_verify_ct"] for m in meta_infos)
    if not verify:
        raise ValueError(f"no spec_verify_ct in {len(meta_infos)} responses: was the server started with EAGLE3?")
    return {
        "acceptance_length": sum(m["completion_tokens"] for m in meta_infos) / verify,
        "verify_steps": verify,
        "per_prompt": [m.get("spec_accept_length") for m in meta_infos],
        "measured_by": "SGLang 0.5.23's spec_accept_length (completion_tokens / spec_verify_ct)",
    }


def generate_meta_info(url: str, prompt: list[int], max_new_tokens: int, timeout: float = 600) -> dict:
    """One greedy `/generate` of `prompt`'s token ids; its `meta_info` (spec_verify_ct, spec_accept_length)."""
    payload = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}
    request = urllib.request.Request(
        url.rstrip("/") + "/generate", json.dumps(payload).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())["meta_info"]


def sglang_eagle3_acceptance(
    target: str | Path,
    draft: str | Path,
    prompts: list[list[int]],
    settings: dict,
    url: str,
    launch: dict,
    log_path: str | Path,
) -> dict:
    """Serve `target` with `draft` under SGLang's EAGLE3 at `url` (`launch`: the config's
    `inference.sglang.launch`, its command, flags and timeouts; `settings`: the `evaluate` section) and
    measure the acceptance length over `prompts`, each decoded greedily up to `max_new_tokens`."""
    from eagle3_datagen.backends.service import launch_args
    from eagle3_datagen.backends.sglang.server import launched_server

    run = {**launch, "args": [*launch_args(launch), *eagle3_launch_args(str(draft), settings["speculative"])]}
    with launched_server(target, url, run, log_path):
        metas = [generate_meta_info(url, prompt, settings["max_new_tokens"]) for prompt in prompts]
    return {**sglang_acceptance(metas), "prompts": len(prompts), "draft": str(draft)}
