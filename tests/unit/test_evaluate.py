"""The evaluate stage's pieces that need no trainer: the held-out samples and prompt, the bootstrap
intervals, the quick fail and the plan's count of the evaluation's cost (the measurement itself runs under
SpecForge's venv: tests/trainers/test_evaluate.py)."""

import io
import json
import logging
import sys

import pytest
import torch
import yaml

from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.formats.files import InputError
from eagle3_datagen.reporting.plan import PartitionPlan, format_plan, plan_evaluation
from eagle3_datagen.stages.evaluate.loss_kernel import kernel_agreement, loss_inputs
from eagle3_datagen.stages.evaluate.measure import (
    bootstrap_interval,
    evaluate_partition,
    held_out_prompt,
    held_out_samples,
)
from eagle3_datagen.stages.evaluate.serving import eagle3_launch_args, sglang_acceptance, sglang_eagle3_acceptance
from eagle3_datagen.stages.evaluate.speculative import AcceptanceTooLow, Decoded, acceptance_length, check_acceptance
from tests.helpers import REPO, defaults, free_port


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


def test_the_held_out_samples_are_the_token_rows_of_the_held_out_ids():
    rows = [{"id": i, "input_ids": [1], "loss_mask": [1]} for i in ("c", "a", "d", "b")]
    assert [r["id"] for r in held_out_samples(iter(rows), ["b", "c", "gone"])] == ["c", "b"]  # rows' order


def row(partition: str, prompts: int, tokens: int) -> PartitionPlan:
    return PartitionPlan(partition, "sglang", prompts, prompts, tokens // 2, tokens // 2, "", None, None, None, 0, "")


def test_the_plan_counts_the_evaluations_training_steps_decoded_tokens_and_node_hours(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the plan reads ./benchmarks: not the checkout's, where `make demo` writes some
    config = fill_defaults(yaml.safe_load((REPO / "config/kimi-k2.5-sglang.yaml").read_text()))
    rows = [row("B1_glaive", 1000, 2_000_000), row("B3_magicoder_evol", 500, 500_000)]
    assert plan_evaluation(config, rows) is None  # commented out in the production config
    config["evaluate"] = fill_defaults({"holdout": 64, "steps": 2000, "max_new_tokens": 256}, "evaluate")
    config["plan"]["throughput"]["train_tokens_per_s"] = 20000
    evaluation = plan_evaluation(config, rows)
    # a draft per partition and one on all three partitions together (the config has three)
    assert evaluation["drafts"] == 3 and evaluation["training_steps"] == 6000
    # steps x batch 4 x mean sample tokens: 2000 and 1000 per partition, 2500000 / 1500 together
    assert evaluation["training_tokens"] == round(2000 * 4 * (2000 + 1000 + 2_500_000 / 1500))
    assert evaluation["decoded_tokens"] == 2 * (64 + 64) * 256  # each partition's draft, then the joint one
    hours = evaluation["training_tokens"] / 20000 / 3600 + evaluation["decoded_tokens"] / 8000 / 3600
    assert evaluation["node_hours"] == pytest.approx(hours)
    assert evaluation["curve_drafts"] == 0 and evaluation["device"] == "CPU"
    config["evaluate"]["baseline"] = "original"
    assert plan_evaluation(config, rows)["drafts"] == 6
    # the data curve at 1/4 and 1/2 (1 is the whole's draft): two more sizes, each as many drafts and steps
    curve = plan_evaluation({**config, "evaluate": {**config["evaluate"], "fractions": [0.25, 0.5, 1.0]}}, rows)
    assert curve["drafts"] == 18 and curve["curve_drafts"] == 12 and curve["training_steps"] == 18 * 2000
    assert curve["training_tokens"] == round(2000 * 4 * (2000 + 1000 + 2_500_000 / 1500) * 2 * 3)
    assert curve["minutes"] is None  # no evaluate job ran here yet
    # minutes per draft as the evaluate jobs here took (Snakemake's benchmarks; two drafts a job with the baseline)
    header = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"
    for path, seconds in (("chat/evaluate/evaluate.tsv", 120.0), ("chat/evaluate/curve/0.5.tsv", 60.0)):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(header + f"{seconds}\t0:01:00\t1\t1\t1\t1\t0\t0\t50\t{seconds}\n")
    timed = plan_evaluation(
        {**config, "evaluate": {**config["evaluate"], "fractions": [0.5]}}, rows, benchmarks=tmp_path
    )
    assert timed["minutes_per_draft"] == pytest.approx(90 / 2 / 60) and timed["minutes"] == pytest.approx(12 * 0.75)
    nothing = dict.fromkeys(("prompts", "prompt_tokens", "completion_tokens", "cost_usd", "hidden_bytes"))
    nothing.update(generation_node_hours=None, hidden_node_hours=None)
    plan = {
        "partitions": [],
        "total": nothing,
        "loads": {},
        "evaluation": evaluation,
        "filesystems": [],
        "recapture": [],
    }
    assert "| evaluate | 3 (0) | 6,000 |" in format_plan(plan)
    # the curve's cost in the printed plan: its drafts among all, and the minutes they take at the measured rate
    line = next(x for x in format_plan({**plan, "evaluation": timed}).splitlines() if x.startswith("| evaluate |"))
    assert line.startswith("| evaluate | 12 (6) | 24,000 |") and line.endswith(" | 9.00 (0.75) |"), line


def test_the_gpu_paths_launch_flags_and_acceptance_from_sglangs_meta_info():
    """The flags are the settings' (SGLang's own parser accepts them: tests/real_sglang); the figure sums
    completion tokens and verify steps over responses, as SGLang's per-request spec_accept_length divides
    them (meta_info as SGLang 0.5.23's TokenizerManager writes it)."""
    speculative = defaults("evaluate")["speculative"]
    args = eagle3_launch_args("results/chat/evaluate/draft-sglang", speculative)
    assert " ".join(args) == (
        "--speculative-algorithm EAGLE3 --speculative-draft-model-path results/chat/evaluate/draft-sglang "
        "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
    )
    metas = [
        {"completion_tokens": 12, "spec_verify_ct": 4, "spec_accept_length": 3.0},
        {"completion_tokens": 5, "spec_verify_ct": 5, "spec_accept_length": 1.0},
    ]
    figures = sglang_acceptance(metas)
    assert figures["acceptance_length"] == 17 / 9 and figures["verify_steps"] == 9
    assert figures["per_prompt"] == [3.0, 1.0]
    with pytest.raises(ValueError, match="was the server started with EAGLE3"):
        sglang_acceptance([{"completion_tokens": 3, "spec_verify_ct": 0}])


def test_eagle3_serving_launches_the_draft_and_measures_sglangs_figures(tmp_path, qwen_tokenizer, caplog):
    """The GPU path's client (scripts/serve_draft.py; SGLang's EAGLE3 needs a GPU, none here): the server is
    launched with the draft's EAGLE3 flags, each prompt decoded greedily, and SGLang's per-request figures
    summed. The server is the loopback stand-in in sglang.launch_server's place, reporting EAGLE3's figures."""
    qwen_tokenizer.save_pretrained(tmp_path / "target")
    launch = defaults("inference.sglang.launch", command=[sys.executable, "-m", "tests.doubles.loopback"])
    settings = defaults("evaluate", max_new_tokens=9)
    prompts = [qwen_tokenizer("Hello there")["input_ids"], qwen_tokenizer("A longer question, please")["input_ids"]]
    url = f"http://127.0.0.1:{free_port()}"
    log = tmp_path / "server.log"
    target, draft = tmp_path / "target", tmp_path / "draft"
    with caplog.at_level(logging.INFO):
        figures = sglang_eagle3_acceptance(target, draft, prompts, settings, url, launch, log)
    # 9 tokens a prompt ("Answer N of M." and the end of turn, cut at 9), a verify step per 4 (3 steps + 1)
    assert figures["prompts"] == 2 and figures["verify_steps"] == 6 and figures["acceptance_length"] == 18 / 6
    started = next(line for line in caplog.text.splitlines() if "starting the SGLang server" in line)
    assert (
        "--speculative-algorithm EAGLE3" in started
        and f"--speculative-draft-model-path {tmp_path / 'draft'} --speculative-num-steps 3" in started
    )


def test_fewer_training_samples_than_a_batch_is_a_user_error_naming_the_export_and_the_fix(tmp_path):
    """SpecForge's loader drops an incomplete batch: an export smaller than evaluate.batch_size would train
    nothing and leave no checkpoint; the job says so before SpecForge starts."""
    export = tmp_path / "export"
    export.mkdir()
    (export / "export.json").write_text(json.dumps({"samples": 3}))
    sample = {"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}
    with pytest.raises(InputError, match=r"3 training samples, fewer than one batch \(evaluate.batch_size 4\)"):
        evaluate_partition([export], [sample], tmp_path / "work", defaults("evaluate", batch_size=4), io.StringIO())


def reference_loss(logits, target, mask):
    """SpecForge 0.2.0's `_compute_loss` as its module writes it (the release runs in tests/trainers)."""
    return -torch.sum(mask * target * torch.log_softmax(logits.float(), dim=2), 2).mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loss_kernel_check_passes_an_equal_loss_and_fails_one_that_ignores_the_mask(dtype):
    """The comparison the GPU check (scripts/loss_kernel_check.py) makes of SpecForge's Triton kernel,
    here between the reference and itself (agree, to the bit) and a loss that ignores the position mask."""
    inputs = loss_inputs(2, 16, 50, dtype=dtype, device="cpu")
    same = kernel_agreement(reference_loss, reference_loss, *inputs)
    assert same["agree"] and same["loss_relative_difference"] == 0 and same["gradient_max_relative_difference"] == 0
    assert same["masked_gradient_zero"] and same["shape"] == [2, 16, 50]

    def unmasked(logits, target, mask):
        return reference_loss(logits, target, torch.ones_like(mask))

    wrong = kernel_agreement(unmasked, reference_loss, *inputs)
    assert not wrong["agree"] and not wrong["masked_gradient_zero"]
    assert wrong["loss_kernel"] > wrong["loss_reference"] * 1.2  # a quarter more positions counted
