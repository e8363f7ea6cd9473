"""The target families of tests/families: their names and shipped configs (config/targets)."""

import yaml

from tests.helpers import REPO

FAMILIES = ("qwen3", "qwen3-hybrid", "deepseek-v3", "gpt-oss", "llama-3.1")
# The families whose run trains a draft on its SpecForge export (and measures its acceptance) and whose
# speculators export vLLM speculators trains on.
EVALUATED = ("gpt-oss",)
# A conversation's system turn and one tool, as the families' token tests render them.
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def family_config(family: str) -> dict:
    return yaml.safe_load((REPO / "config/targets" / f"{family}.yaml").read_text())


def partition(family: str) -> str:
    [name] = family_config(family)["partitions"]
    return name
