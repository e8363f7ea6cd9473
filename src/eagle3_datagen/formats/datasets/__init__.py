"""Raw chat datasets in their own layouts -> conversations in OpenAI layout, and prompts from them.

A prompt keeps the system message and the user turns of a conversation; the original
assistant turns are dropped because the target model regenerates them. Tool conversations
keep their declared tools and their recorded calls and results in OpenAI layout, with
Kimi's call ids: generation compares the regenerated calls with them and reuses the
results of those that match (docs/formats.md).

- `common`: the parsed conversation, skip and bad-record reasons, tool and call readers.
- `chats`: ShareGPT (with Hermes' and ToolACE's tool dialects), OpenAI, Alpaca, problem/solution,
  query/answer.
- `toolcalls`: glaive, Hermes tags, ToolACE's function list and calls, xLAM.
- `prompts`: the layout per record, call linking, the turns a prompt keeps, ids, `normalize`.
"""

from eagle3_datagen.formats.datasets.common import BadRecord, Parsed, SkipRecord
from eagle3_datagen.formats.datasets.prompts import (
    FORMATS,
    PARSERS,
    conversation_id,
    detect_format,
    link_tool_calls,
    normalize,
    parse,
    prompt_messages,
    recorded_conversations,
)

__all__ = [
    "FORMATS",
    "PARSERS",
    "BadRecord",
    "Parsed",
    "SkipRecord",
    "conversation_id",
    "detect_format",
    "link_tool_calls",
    "normalize",
    "parse",
    "prompt_messages",
    "recorded_conversations",
]
