"""The canary: before the first job of a real run that will call OpenRouter, one request with the run's
exact model, provider routing, sampling, token limit and reasoning settings.

A provider that refuses what every request of the run would send (a temperature it does not take, a
routing no endpoint meets, a key without credits) refuses the canary the same way: the run stops in
`onstart`, before any job, naming the provider's own message, instead of recording every prompt as
failed. A canary that gets no answer (an outage, rate limits past the retries) does not stop the run:
its jobs retry, and `inference.max_failed_rate` fails the shards whose prompts keep failing. An
answered canary also clears a stop the endpoint's ledger holds from an earlier run (a key since
fixed). A dry-run sends nothing (Snakemake calls no `onstart` there). It costs one short answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from eagle3_datagen.backends.base import MissingApiKey, RequestFailed, RetryableError, StopRun
from eagle3_datagen.backends.ledger import clear_stop
from eagle3_datagen.backends.plugins import GENERATION
from eagle3_datagen.workflow.partitions import inference_backend
from eagle3_datagen.workflow.preflight import Job, priced_partitions
from eagle3_datagen.workflow.settings import merged, response_run_settings
from eagle3_datagen.workflow.settings import response_settings as rule_settings

QUESTION = [{"role": "user", "content": "Reply with the single word OK."}]


def check(config: dict, jobs: Iterable[Job], say: Callable[[str], None]) -> list[str]:
    """Send the canary where OpenRouter responses are scheduled among `jobs`; what stops the run (the
    provider's refusal), one line each. `say` gets a line on what the canary got."""
    partitions = priced_partitions(config, jobs)
    if not partitions:
        return []
    # Every OpenRouter partition sends the same settings (the backend's section and its sampling).
    settings = merged(rule_settings(config, partitions[0]), response_run_settings(config))
    try:  # built through its registry entry: aiohttp is imported only where it is used
        backend = GENERATION[inference_backend(config, partitions[0])].build(settings)
    except MissingApiKey:
        return []  # preflight names the unset variable
    sent = (
        f"model {backend.model}, provider {backend.provider}, sampling {backend.sampling}, max_tokens "
        f"{backend.max_tokens}, reasoning {backend.reasoning}"
    )
    try:
        turn = asyncio.run(_ask(backend))
    except (StopRun, RequestFailed) as e:
        return [
            f"OpenRouter refused the canary request, sent with the settings of {', '.join(partitions)} ({sent}): "
            f"{e}. Every request of the run would be refused: fix the setting it names (inference.openrouter, "
            "inference.sampling or inference.openrouter.sampling), or the key's account"
        ]
    except RetryableError as e:
        say(
            f"canary: OpenRouter gave no answer ({e.reason}) after {backend.client.retry.max_attempts} attempts; "
            "the run goes on (inference.max_failed_rate fails a shard whose prompts keep failing)"
        )
        return []
    if clear_stop(config["inference"]["ledger_dir"], backend.name, backend.model):
        say(f"canary: cleared the stop an earlier run left in the ledger of {backend.model}")
    produced = turn.extra["produced_by"]
    say(
        f"canary: {backend.model} answered through {produced['provider']} ({sent}): finish_reason "
        f"{produced['finish_reason']}, {turn.usage['completion_tokens']} tokens, ${turn.usage['cost']}"
    )
    return []


async def _ask(backend):
    async with backend:
        return await backend.generate(QUESTION, None)
