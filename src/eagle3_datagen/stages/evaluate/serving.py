"""The GPU path's pieces (not run here: no GPU): SGLang 0.5.23 serving the target with the trained draft
(EAGLE3), and the acceptance length read from SGLang's own per-request figures.

The launch flags are `ServerArgs` fields of SGLang 0.5.23 (checked against its own parser: tests/real_sglang).
Each response's `meta_info` carries `spec_verify_ct` (verify steps) and `completion_tokens`; SGLang's
`spec_accept_length` is their ratio (`TokenizerManager`: completion tokens / verify steps, the bonus token
included, and the prefill's first token, which the CPU path leaves out). Summed over the held-out prompts
it is the figure the CPU path measures (speculative.py: `acceptance_length`), up to that first token.
"""

from __future__ import annotations


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
