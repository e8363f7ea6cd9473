"""The evaluate stage's pieces that need no trainer: the held-out prompt, the bootstrap interval and the
quick fail (the measurement itself runs under SpecForge's venv: tests/trainers/test_evaluate.py)."""

import pytest

from eagle3_datagen.stages.evaluate.measure import bootstrap_interval, held_out_prompt
from eagle3_datagen.stages.evaluate.speculative import AcceptanceTooLow, Decoded, acceptance_length, check_acceptance


def test_the_held_out_prompt_is_everything_before_the_last_answer():
    # two turns in the loss (keep_all-style mask): the prompt keeps the first answer and the second question
    sample = {"id": "a", "input_ids": list(range(12)), "loss_mask": [0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0]}
    assert held_out_prompt(sample) == list(range(7))
    with pytest.raises(ValueError, match="sample b: no prompt"):
        held_out_prompt({"id": "b", "input_ids": [1, 2], "loss_mask": [1, 1]})


def test_acceptance_length_is_committed_tokens_by_verify_steps():
    one = Decoded([1], tokens=[5, 6, 7, 8, 9, 10], starts=[1, 5], accepted=[3, 0])  # 4 + 1 committed
    two = Decoded([1], tokens=[5, 6, 7], starts=[1], accepted=[1])
    assert one.committed == 5 and one.acceptance_length == 2.5
    assert acceptance_length([one, two]) == 7 / 3
    assert Decoded([1], tokens=[2]).acceptance_length is None  # the prefill's token ended it
    with pytest.raises(ValueError, match="no verify step in 1 held-out prompts"):
        acceptance_length([Decoded([1], tokens=[2])])


def test_bootstrap_interval_brackets_the_ratio_and_is_reproducible():
    committed, steps = [8, 4, 12, 3, 9, 6], [4, 4, 4, 3, 3, 3]
    low, high = bootstrap_interval(committed, steps, reps=500, seed=1)
    assert low < sum(committed) / sum(steps) < high
    assert low >= 1.0 and high <= 4.0  # within the per-prompt extremes
    assert bootstrap_interval(committed, steps, reps=500, seed=1) == [low, high]
    assert bootstrap_interval([4, 4], [2, 2], reps=50) == [2.0, 2.0]


def test_the_quick_fail_names_the_partition_the_value_and_the_causes():
    check_acceptance("chat", 2.0, 1.5)
    with pytest.raises(AcceptanceTooLow) as raised:
        check_acceptance("chat", 1.234, 1.5)
    message = str(raised.value)
    assert message.startswith("partition chat: acceptance length 1.234 is below evaluate.min_acceptance_length 1.5")
    assert "the data is kept" in message and "aux_layers" in message and "loss mask" in message
