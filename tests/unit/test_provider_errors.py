"""The errors of OpenRouter and of the providers behind it, classified from their real bodies
(tests/fixtures/provider_errors.yaml, each with where it was read): a refused prompt is that prompt's
failure with the provider's reason, what every request sends stops the run, the rest is retried."""

import json

import pytest

from eagle3_datagen.backends.base import RequestFailed, RetryableError, StopRun
from eagle3_datagen.backends.http import classify, parse_retry_after, read_error
from tests.doubles.loopback import PROVIDER_ERRORS

CLASSES = {"RequestFailed": RequestFailed, "RetryableError": RetryableError, "StopRun": StopRun}
ANSWERS = {name: entry for name, entry in PROVIDER_ERRORS.items() if "body" in entry and entry["status"] != 200}


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_each_error_body_gets_its_class_and_reason(name):
    entry = ANSWERS[name]
    error = classify(entry["status"], entry["body"], parse_retry_after(entry.get("retry_after")))
    assert type(error) is CLASSES[entry["expect"]["class"]]
    if isinstance(error, RequestFailed):
        assert error.kind == entry["expect"]["reason"]
    said = read_error(entry["body"])
    # The message names the provider's own words, not OpenRouter's "Provider returned error".
    assert (said.raw or said.message)[:40] in str(error)
    assert "Provider returned error" not in str(error)


def test_every_fixture_names_its_source_and_the_set_covers_each_kind():
    assert all(entry["source"].strip() for entry in PROVIDER_ERRORS.values())
    kinds = {entry["expect"].get("reason") for entry in PROVIDER_ERRORS.values()}
    assert kinds >= {"context_overflow", "moderation", "guardrail", "provider_refused", "too_large"}
    statuses = {entry["status"] for entry in PROVIDER_ERRORS.values()}
    assert statuses >= {200, 400, 401, 402, 403, 404, 408, 413, 429, 502, 503}


def test_the_issue_s_bodies_no_longer_stop_the_run():
    """Issue 44: a wrapped provider 400 ("provider") and Moonshot's overflow ("model") were read as settings."""
    for name in ("openrouter_wrapped_chutes_400", "moonshot_context_overflow", "moonshot_context_overflow_wrapped"):
        entry = PROVIDER_ERRORS[name]
        assert isinstance(classify(entry["status"], entry["body"], None), RequestFailed), name
    wrapped = classify(400, PROVIDER_ERRORS["moonshot_context_overflow_wrapped"]["body"], None)
    assert str(wrapped) == (
        "HTTP 400 from Moonshot AI: Invalid request: Your request exceeded model token limit: 262144 "
        "(requested: 269030)"
    )


def test_retry_after_is_kept_and_a_402_with_it_is_retried():
    entry = PROVIDER_ERRORS["rate_limit_429_wrapped"]
    error = classify(429, entry["body"], parse_retry_after(entry["retry_after"]))
    assert isinstance(error, RetryableError) and error.retry_after == 60.0
    assert "temporarily rate-limited upstream" in error.reason and "BaseTen" in error.reason
    assert isinstance(classify(402, PROVIDER_ERRORS["credits_402"]["body"], 5.0), RetryableError)


def test_a_wrapped_400_naming_a_sampling_parameter_stops_the_run():
    """A provider's own `param` names what it refused: a setting every request carries."""
    body = PROVIDER_ERRORS["temperature_400"]["body"]
    wrapped = {"error": {"message": "Provider returned error", "code": 400, "metadata": {"raw": json.dumps(body)}}}
    assert isinstance(classify(400, wrapped, None), StopRun)
