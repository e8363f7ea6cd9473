"""Greedy chain speculative decoding on the CPU: the target verifies an EAGLE-3 draft's proposals.

On a GPU node SGLang 0.5.23's EAGLE3 path is the measurement; on the CPU, where SGLang has no EAGLE3
kernels, this is the same algorithm at top-k 1. Each verify step the draft proposes `steps` tokens one
after another from the target's auxiliary states of the committed tokens, the target runs once over the
committed tokens and the proposals, the longest run of proposals equal to the target's greedy tokens is
accepted and the target's own token after it (the bonus) is committed with them. Acceptance length is
committed tokens / verify steps, the bonus included, as SGLang's `spec_accept_length`; SGLang's count
also includes the first token (from the prefill, no verify step), which is left out here, so the figure
lies in [1, steps + 1].

The draft is SpecForge's model class (`LlamaForCausalLMEagle3`), run through the methods its TTT training
loop calls (`embed_input_ids`, `project_hidden_states`, `backbone`, `compute_logits`) with the same
attention: the k-th proposal attends to the draft's step-0 keys of the committed tokens and to its own
keys of the proposals before it (SpecForge's `cache_hidden`). The draft pairs the target's state at
token t with token t + 1 (SpecForge's `TargetHead.preprocess` shift).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Decoded:
    """One held-out prompt decoded: the committed tokens and, per verify step, where it started (the
    index of the last committed token) and how many proposals the target accepted."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    @property
    def committed(self) -> int:
        """Tokens committed by verify steps (each step's accepted proposals and its bonus token)."""
        return sum(self.accepted) + len(self.accepted)

    @property
    def acceptance_length(self) -> float | None:
        """None where the prefill's token ended the answer (no verify step)."""
        return self.committed / len(self.accepted) if self.accepted else None


@torch.inference_mode()
def target_pass(target, ids: list[int], aux_layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's auxiliary states [L, A*H] (hidden_states indices, the capture's `aux_layers`) and
    its greedy next token at every position [L]."""
    out = target(input_ids=torch.tensor([ids]), output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i][0] for i in aux_layers], dim=-1)
    return aux, out.logits[0].argmax(-1)


@torch.inference_mode()
def propose(draft, aux: torch.Tensor, next_ids: list[int], steps: int) -> list[int]:
    """The draft's `steps` proposals (target token ids) after the committed tokens x_0..x_n, from the
    target's states at x_0..x_{n-1} (`aux`, [n, A*H]) and x_1..x_n (`next_ids`)."""
    n = len(next_ids)
    hidden = draft.project_hidden_states(aux[None].to(draft.fc.weight.dtype))
    mask = draft.prepare_decoder_attention_mask(torch.ones(1, n, dtype=torch.bool), hidden, 1, n, 0)
    positions = torch.arange(n)[None]
    ids = torch.tensor([next_ids])
    cache: list[list[torch.Tensor]] = [[], []]
    proposals = []
    for _ in range(steps):
        embeds = draft.embed_input_ids(ids).to(hidden.dtype)
        hidden = draft.backbone(
            input_embeds=embeds, hidden_states=hidden, cache_hidden=cache, attention_mask=mask, position_ids=positions
        )
        token = int(draft.compute_logits(hidden[:, -1]).argmax(-1))
        token += int(draft.d2t[token])
        proposals.append(token)
        # Only the last position's chain matters; the others' inputs shift as in training.
        ids = torch.cat([ids[:, 1:], torch.tensor([[token]])], dim=1)
    return proposals


def speculative_decode(
    target, draft, prompt: list[int], aux_layers: list[int], steps: int, max_new_tokens: int, stop_ids=()
) -> Decoded:
    """Greedy chain speculative decoding of `prompt` until `max_new_tokens` or a stop token.

    The committed tokens are the target's own greedy continuation (verification keeps nothing else)."""
    decoded = Decoded(list(prompt))
    aux, greedy = target_pass(target, prompt, aux_layers)
    sequence = [*prompt, int(greedy[-1])]  # the prefill's token
    while len(sequence) - len(prompt) < max_new_tokens and sequence[-1] not in stop_ids:
        n = len(sequence) - 1
        proposals = propose(draft, aux[:n], sequence[1:], steps)
        aux, greedy = target_pass(target, sequence + proposals, aux_layers)
        accepted = 0
        while accepted < steps and proposals[accepted] == int(greedy[n + accepted]):
            accepted += 1
        decoded.starts.append(n)
        decoded.accepted.append(accepted)
        sequence += [*proposals[:accepted], int(greedy[n + accepted])]
        aux = aux[: n + accepted + 1]
    tokens = sequence[len(prompt) :]
    stops = [i for i, token in enumerate(tokens) if token in stop_ids]
    decoded.tokens = tokens[: stops[0] + 1] if stops else tokens
    return decoded


def acceptance_length(decoded: list[Decoded]) -> float:
    """Over several prompts: summed committed tokens by summed verify steps (SGLang's server-wide figure)."""
    steps = sum(len(d.accepted) for d in decoded)
    if not steps:
        raise ValueError(f"no verify step in {len(decoded)} held-out prompts: every answer ended at its first token")
    return sum(d.committed for d in decoded) / steps


# What most often leaves a draft trained on the data far below the target's usual acceptance.
COMMON_CAUSES = (
    "auxiliary states from other layers than the draft reads (hidden_states.aux_layers against the export's "
    "specforge_aux_layer_ids)",
    "a loss mask off by a token (chat template or tokenization drift between responses and tokens)",
    "responses that are not the target's own (a different model, sampling settings or template)",
    "final hidden states with the final norm applied twice or not at all (hidden_states.final)",
    "too few training steps or samples for a draft to learn anything (evaluate.steps, the partition's size)",
)


class AcceptanceTooLow(RuntimeError):
    """The quick fail: a partition's measured acceptance length below `evaluate.min_acceptance_length`."""


def check_acceptance(partition: str, value: float, minimum: float) -> None:
    """Raise `AcceptanceTooLow` naming the partition, the measured value and the common causes."""
    if value < minimum:
        causes = "".join(f"\n  - {cause}" for cause in COMMON_CAUSES)
        raise AcceptanceTooLow(
            f"partition {partition}: acceptance length {value:.3f} is below evaluate.min_acceptance_length "
            f"{minimum}; the data is kept. Common causes:{causes}"
        )
