"""The paired comparison of two drafts on the same held-out prompts, on figures whose answers are known."""

import pytest

from eagle3_datagen.paired_acceptance import paired_comparison, prompt_figures


def test_per_prompt_figures_count_each_steps_proposals_and_its_bonus_token():
    per_prompt = [{"id": "a", "accepted": [3, 0, 2]}, {"id": "b", "accepted": []}]
    assert prompt_figures(per_prompt) == {"a": (8, 3), "b": (0, 0)}


def test_both_lengths_their_difference_and_the_interval_of_two_prompts():
    # Two prompts: a resample is (a, a), (b, b) or mixed, with chances 1/4, 1/4, 1/2. The draft commits
    # 4 then 2 tokens in 2 steps, the baseline 2 and 2: differences 1.0, 0.0, 0.5 -> a 95% interval [0, 1].
    draft = {"a": (4, 2), "b": (2, 2)}
    baseline = {"a": (2, 2), "b": (2, 2)}
    result = paired_comparison(draft, baseline, reps=2000, seed=0)
    assert result["draft_acceptance_length"] == 6 / 4 and result["acceptance_length"] == 1.0  # the baseline's
    assert result["difference"] == 0.5
    assert result["difference_interval_95"] == [0.0, 1.0]
    assert (result["prompts"], result["prompts_resampled"], result["reps"], result["seed"]) == (2, 2, 2000, 0)
    assert paired_comparison(draft, baseline, reps=2000, seed=0) == result  # fixed seed: the same interval
    # the other way round, the difference and its interval change sign
    assert paired_comparison(baseline, draft)["difference_interval_95"] == [-1.0, 0.0]


def test_pairing_cancels_what_prompts_do_to_both_drafts():
    """Prompts of very different acceptance, the draft one step's worth ahead of the baseline on each
    (same steps, one more token per step): every resample differs by exactly one token per step, where
    intervals of the two lengths taken apart would overlap widely."""
    steps = {f"p{i}": 2 + i for i in range(10)}
    base = {p: (s * (1 + i % 3), s) for i, (p, s) in enumerate(steps.items())}
    draft = {p: (c + s, s) for p, (c, s) in base.items()}
    result = paired_comparison(draft, base, reps=500, seed=3)
    assert result["difference"] == pytest.approx(1.0)
    assert result["difference_interval_95"] == pytest.approx([1.0, 1.0])


def test_prompts_without_a_verify_step_are_left_out_of_the_resamples_and_mismatched_prompts_fail():
    draft = {"a": (4, 2), "b": (2, 2), "short": (0, 0)}
    baseline = {"a": (2, 2), "b": (2, 2), "short": (0, 0)}
    result = paired_comparison(draft, baseline, reps=200)
    assert (result["prompts"], result["prompts_resampled"], result["difference"]) == (3, 2, 0.5)
    with pytest.raises(ValueError, match="different prompts: 1 in one only, e.g. \\['c'\\]"):
        paired_comparison({**draft, "c": (1, 1)}, baseline)
    with pytest.raises(ValueError, match="no verify step in 1 held-out prompts"):
        paired_comparison({"short": (0, 0)}, {"short": (0, 0)})
