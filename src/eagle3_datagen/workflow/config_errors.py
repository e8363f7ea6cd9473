"""A config that fails the schema, said in a few lines: each error's key, value and what is allowed.

Snakemake's `validate` reports the first error with the whole schema under it (over a thousand lines
for a misspelled top-level key); the Snakefile catches that and raises `describe`'s lines instead.
"""

from __future__ import annotations

import difflib
from pathlib import Path

import jsonschema
import yaml
from jsonschema.exceptions import ValidationError, relevance

MAX_ERRORS = 5
# Values under these keys are never echoed: a pasted API key must not reach a console or a log.
SECRET_PARENTS = (("inference", "openrouter"),)


def describe(config: dict, schema_path: str | Path, config_files: list[str]) -> str:
    """Every way `config` fails the schema (the most relevant first, at most MAX_ERRORS), one line each."""
    schema = yaml.safe_load(Path(schema_path).read_text())
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(config), key=relevance, reverse=True)
    files = ", ".join(str(f) for f in config_files)
    lines = [f"The config ({files}) does not match the schema {schema_path}:"]
    lines += [f"- {_line(error, schema)}" for error in errors[:MAX_ERRORS]]
    if len(errors) > MAX_ERRORS:
        lines.append(f"- and {len(errors) - MAX_ERRORS} more")
    return "\n".join(lines)


def _where(path) -> str:
    return ".".join(str(part) for part in path) or "the top level"


def _line(error: ValidationError, schema: dict) -> str:
    where = _where(error.absolute_path)
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        unknown = sorted(set(error.instance) - set(allowed))
        return "; ".join(_unknown_key(where, key, allowed) for key in unknown)
    if "propertyNames" in error.schema_path:
        # a key refused by name (the schema's enum of names): the error's instance is the key
        return _unknown_key(where, error.instance, list(error.validator_value))
    message = error.message
    if any(tuple(error.absolute_path)[: len(parent)] == parent for parent in SECRET_PARENTS):
        message = message.replace(repr(error.instance), "the value given")
    # a value's own description (what it is for), not an object's that lacks a required key
    leaf = isinstance(error.schema, dict) and error.validator != "required" and "properties" not in error.schema
    description = error.schema.get("description") if leaf else None
    return f"{where}: {message}" + (f" ({description})" if description else "")


def _unknown_key(where: str, key: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f": did you mean '{close[0]}'?" if close else ""
    return f"{where}: '{key}' was unexpected{hint} Allowed: {', '.join(allowed)}"
