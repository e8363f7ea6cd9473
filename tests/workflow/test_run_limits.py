"""The OpenRouter path at a run's scale, through Snakemake as a user runs it: four shard jobs share one
concurrency and one budget, a provider's outage fails the run and a rerun asks again only for what
failed, a raised max_new_tokens asks again only for the truncated answers, and a refused setting stops
the run before any job.

The workflow is the real one (`snakemake` on a copy of it: the prompts and responses rules, the
responses jobs' `scripts/responses.py`, the run's ledger under results/.ledger, the canary in
`onstart`); the HTTP server is the loopback double (tests/doubles), which speaks OpenRouter's API, counts
the requests in flight and each prompt's answers, and injects the faults.
"""

import hashlib
import json
import re
import shutil

import pytest
import yaml

from eagle3_datagen.formats.files import read_jsonl
from eagle3_datagen.formats.journal import journal_path
from tests.doubles.loopback import FaultPlan, Loopback, serve_in_thread
from tests.helpers import KEY_ENV, copy_workflow, snakemake

pytestmark = pytest.mark.e2e

PARTITION = "api"
CANARY = "Reply with the single word OK."


@pytest.fixture
def workflow(tmp_path, qwen_tokenizer_dir, api_key):
    """A copy of the workflow with a source of 400 alpaca records of 1 to 8 words, and a model directory
    holding a tokenizer and a config (the responses jobs read no weights; preflight checks the files)."""
    work = copy_workflow(tmp_path / "wf")
    model = tmp_path / "model"
    shutil.copytree(qwen_tokenizer_dir, model)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 64}))
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    records = [{"instruction": f"Q{i} " + " ".join(words[: 1 + i % 8]), "output": "A."} for i in range(400)]
    (work / "source.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return work, model


def write_config(work, model, url, shards, prompts, **openrouter) -> str:
    config = {
        "model": {"path": str(model)},
        "partitions": {
            PARTITION: {"source": "source.jsonl", "format": "alpaca", "shards": shards, "max_prompts": prompts}
        },
        "inference": {
            "backend": "openrouter",
            "sampling": {"max_new_tokens": 64, "temperature": 0.0},
            "openrouter": {
                "base_url": url,
                "model": "moonshotai/kimi-k2.5",
                "api_key_env": KEY_ENV,
                "reasoning": {"enabled": False},
                "retry": {"max_attempts": 1},
                **openrouter,
            },
        },
        "tokens": {},
        "hidden_states": {"aux_layers": "auto", "dtype": "bfloat16", "shard_bytes": 1 << 20},
        "resources": {"gpus_per_node": 1},
    }
    (work / "run.yaml").write_text(yaml.safe_dump(config))
    return "run.yaml"


def responses(work, shards: int, *extra: str, check=True):
    """Snakemake for the partition's response shards, all of them at once (two cores each)."""
    targets = [f"results/{PARTITION}/responses/{s:05d}.jsonl.zst" for s in range(shards)]
    return snakemake(
        [*targets, "--cores", str(2 * shards), "--keep-going", "--configfile", "run.yaml", *extra], work, check
    )


# The canary's request, as the loopback keys it (its messages' JSON).
CANARY_KEY = hashlib.sha256(json.dumps([{"role": "user", "content": CANARY}]).encode()).hexdigest()


def answered(server) -> dict:
    """The prompts' answers the server gave, by request content (the canary's left out)."""
    return {key: n for key, n in server.completed.items() if key != CANARY_KEY}


def shares_seen(work) -> list[tuple[int, int]]:
    """(share, live jobs) of every share a job's log reports."""
    found = []
    for log in (work / "logs" / PARTITION / "responses").glob("*.log"):
        found += [(int(a), int(b)) for a, b in re.findall(r"concurrency: (\d+) of 40, (\d+) jobs", log.read_text())]
    return found


# USD per million tokens the loopback bills and the budget reserves at: an answer here costs about
# $0.0006, a request's worst case (about 100 prompt bytes and 64 tokens) about $0.0042.
PRICES = {"prompt": 10.0, "completion": 50.0}
# The canary's answer, billed by the loopback but no job's: 6 prompt words, "Reply to: ..." and 4 more.
CANARY_COST = (6 * PRICES["prompt"] + 12 * PRICES["completion"]) / 1e6


def test_four_jobs_share_one_concurrency_and_one_budget(workflow, api_key):
    """Four shard jobs at concurrency 40 and a $0.10 budget, then the budget raised to $0.20 (the spend
    under results/ counts), then none: never more than 40 requests in flight at the server, the bill
    (the canaries' left out) never past a budget, each run stopped within a request's worst case of it,
    every prompt answered once."""
    work, model = workflow
    server = Loopback("unused", api_key=api_key, faults=FaultPlan(latency_s=0.25), prices=PRICES)
    budget = {"price_per_million": PRICES, "concurrency": 40}
    with serve_in_thread(server) as url:
        write_config(work, model, url, 4, 400, max_cost_usd=0.10, **budget)
        first = responses(work, 4, check=False)
        after_first = server.billed - CANARY_COST
        write_config(work, model, url, 4, 400, max_cost_usd=0.20, **budget)
        second = responses(work, 4, check=False)
        after_second = server.billed - 2 * CANARY_COST
        write_config(work, model, url, 4, 400, concurrency=40)
        responses(work, 4)
    assert first.returncode != 0 and "the budget is reached" in first.stderr, first.stderr
    assert second.returncode != 0 and "the budget is reached" in second.stderr, second.stderr
    worst = (120 * PRICES["prompt"] + 64 * PRICES["completion"]) / 1e6  # above every request's here
    assert 0.10 - worst < after_first <= 0.10, after_first
    assert 0.20 - worst < after_second <= 0.20, after_second
    assert server.max_in_flight <= 40, server.max_in_flight
    counts = answered(server)
    assert len(counts) == 400 and set(counts.values()) == {1}, counts  # every prompt answered, none twice
    rows = [r for s in range(4) for r in read_jsonl(work / f"results/{PARTITION}/responses/{s:05d}.jsonl.zst")]
    assert len(rows) == 400 and {r["status"] for r in rows} == {"ok"}
    shares = shares_seen(work)
    assert max(jobs for _, jobs in shares) >= 2, shares  # jobs ran side by side, sharing
    print(
        f"\nbilled ${after_first:.4f} under $0.10, ${after_second:.4f} under $0.20; max in flight "
        f"{server.max_in_flight} of 40; shares seen {sorted(set(shares))}"
    )


def test_an_outage_fails_the_run_and_the_rerun_asks_only_for_what_failed_then_a_raised_limit_for_what_was_cut(
    workflow, api_key
):
    """60% of the requests fail (one attempt each): both jobs fail saying how many and why. Against the
    healthy server the rerun answers every prompt, asking none again that was answered. Then a raised
    max_new_tokens (OpenRouter's own sampling block) asks again only for the answers cut at the old one."""
    work, model = workflow
    server = Loopback("unused", api_key=api_key, faults=FaultPlan(rate=0.6, sequence=[503]))
    with serve_in_thread(server) as url:
        write_config(work, model, url, 2, 100, concurrency=8, sampling={"max_new_tokens": 10})
        outage = responses(work, 2, check=False)
        during = dict(answered(server))
        server.faults = FaultPlan()
        responses(work, 2)
        after = dict(answered(server))
        cut = {
            r["id"]
            for s in range(2)
            for r in read_jsonl(work / f"results/{PARTITION}/responses/{s:05d}.jsonl.zst")
            if r["status"] == "truncated"
        }
        write_config(work, model, url, 2, 100, concurrency=8, sampling={"max_new_tokens": 64})
        responses(work, 2)
        raised = dict(answered(server))
    said = re.findall(r"error: results/api/responses/0000\d.jsonl.zst: (\d+) of (\d+) prompts failed", outage.stderr)
    assert outage.returncode != 0 and len(said) == 2, outage.stderr[-3000:]
    failed = [int(n) for n, _ in said]
    assert sum(int(total) for _, total in said) == 100
    assert 0.4 < sum(failed) / 100 < 0.8
    assert outage.stderr.count("'retries exhausted: HTTP 503: injected 503'") == 2
    assert sum(during.values()) == 100 - sum(failed)
    # the rerun: the failed prompts only, each answered once
    assert len(after) == 100 and set(after.values()) == {1}
    # the raised limit: the truncated prompts asked again, the others kept from the journal
    assert 0 < len(cut) < 100
    again = {k for k in raised if raised[k] == 2}
    assert len(again) == len(cut) and sum(raised.values()) == 100 + len(cut)
    rows = [r for s in range(2) for r in read_jsonl(work / f"results/{PARTITION}/responses/{s:05d}.jsonl.zst")]
    assert {r["status"] for r in rows} == {"ok"}
    assert all(journal_path(work / f"results/{PARTITION}/responses/{s:05d}.jsonl.zst").exists() for s in range(2))
    print(
        f"\noutage: {sum(failed)} of 100 failed; rerun asked {sum(after.values()) - sum(during.values())}, "
        f"again for answered: 0; raised max_new_tokens asked again {len(again)} (truncated {len(cut)})"
    )


def test_a_refused_temperature_stops_a_real_run_before_any_job(workflow, api_key):
    """A provider that takes only temperature 1: the canary's 400 stops the run in onstart, naming the
    provider's message; no job ran. A dry-run sends nothing."""
    work, model = workflow
    server = Loopback("unused", api_key=api_key, faults=FaultPlan(require={"temperature": 1.0}))
    with serve_in_thread(server) as url:
        write_config(work, model, url, 2, 10, concurrency=8)
        dry = responses(work, 2, "-n")
        requests_in_dry_run = sum(server.attempts.values())
        real = responses(work, 2, check=False)
    assert requests_in_dry_run == 0 and "rule responses" in dry.stdout
    out = real.stdout + real.stderr
    assert real.returncode != 0
    assert "OpenRouter refused the canary request" in out and "invalid temperature: only 1.0 is allowed" in out
    assert sum(server.attempts.values()) == 1  # the canary alone
    assert not (work / "results").exists() and not (work / "logs").exists()  # no job ran
    print("\n" + next(line for line in out.splitlines() if "refused the canary" in line))


def test_a_few_refused_prompts_among_hundreds_end_the_run_green(workflow, api_key):
    """400 prompts over two shard jobs; 4 refused by the provider with real bodies (a wrapped Moonshot
    overflow, a moderation 403, a wrapped provider 400, SGLang's overflow), 2 answered after a stream that
    ends in an error or is cut. Under max_failed_rate 0.02 the run ends green: every good prompt answered
    once, each refusal journaled with its reason and asked once, no run stop; each job's log counts its
    failures per reason."""
    work, model = workflow
    refusals = {
        "Q17 ": "moonshot_context_overflow_wrapped",
        "Q123 ": "moderation_403",
        "Q250 ": "openrouter_wrapped_chutes_400",
        "Q61 ": "sglang_context_overflow",
    }
    transient = {"Q5 ": "stream_error_midway", "Q88 ": "cut"}
    server = Loopback("unused", api_key=api_key, faults=FaultPlan(answers=refusals, answers_once=transient))
    with serve_in_thread(server) as url:
        write_config(work, model, url, 2, 400, concurrency=16, retry={"max_attempts": 3})
        config = yaml.safe_load((work / "run.yaml").read_text())
        config["inference"]["max_failed_rate"] = 0.02
        (work / "run.yaml").write_text(yaml.safe_dump(config))
        responses(work, 2)
    rows = [r for s in range(2) for r in read_jsonl(work / f"results/{PARTITION}/responses/{s:05d}.jsonl.zst")]
    asked = {
        p["id"]: p["messages"][-1]["content"].split()[0]
        for s in range(2)
        for p in read_jsonl(work / f"results/{PARTITION}/prompts/{s:05d}.jsonl.zst")
    }
    failed = {asked[r["id"]]: r for r in rows if r["status"] == "failed"}
    assert len(rows) == 400 and sorted(failed) == ["Q123", "Q17", "Q250", "Q61"]
    assert {q: r["failure"] for q, r in failed.items()} == {
        "Q17": "context_overflow", "Q123": "moderation", "Q250": "provider_refused", "Q61": "context_overflow"
    }  # fmt: skip
    assert "exceeded model token limit: 262144 (requested: 269030)" in failed["Q17"]["error"]
    assert all(r["asked"] == 1 for r in failed.values())
    prompts = answered(server)
    assert len(prompts) == 396 and set(prompts.values()) == {1}  # every good prompt answered, once
    attempts = [n for key, n in server.attempts.items() if key != CANARY_KEY]
    assert sorted(attempts).count(2) == 2 and max(attempts) == 2 and len(attempts) == 400
    logs = "".join(p.read_text() for p in (work / "logs" / PARTITION / "responses").glob("*.log"))
    assert logs.count("'failures': {") == 2 and "'context_overflow': " in logs and "'moderation': 1" in logs
    print(f"\n400 prompts, 4 refused (asked once each), 2 streams retried once; requests {sum(attempts)}")
