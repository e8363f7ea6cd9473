"""Raw chat datasets in their own layouts -> conversations in OpenAI layout, and prompts from them.

A prompt keeps the system message and the user turns of a conversation; the original
assistant turns are dropped because the target model regenerates them. Tool conversations
keep their declared tools and their recorded calls and results in OpenAI layout, with
Kimi's call ids: generation compares the regenerated calls with them and reuses the
results of those that match (docs/formats.md).

- `common`: the layouts' registry (`LAYOUTS`: a parser registers itself with `@layout(name, needs)`; a
  new layout is a module here, imported by `prompts`, and the schema's `format` enum),
  the parsed conversation, skip and bad-record reasons, tool and call readers.
- `chats`: ShareGPT (with Hermes' and ToolACE's tool dialects), OpenAI, Alpaca, problem/solution,
  query/answer.
- `toolcalls`: glaive, Hermes tags, ToolACE's function list and calls, xLAM.
- `prompts`: the layout per record, call linking, the turns a prompt keeps, ids, `normalize`.
"""

from eagle3_datagen.formats.datasets.common import LAYOUTS, BadRecord, Layout, Parsed, SkipRecord
from eagle3_datagen.formats.datasets.prompts import (
    LAYOUT_CHOICES,
    conversation_id,
    detect_layout,
    link_tool_calls,
    normalize,
    parse,
    prompt_messages,
    recorded_conversations,
)

__all__ = [
    "LAYOUTS",
    "LAYOUT_CHOICES",
    "BadRecord",
    "Layout",
    "Parsed",
    "SkipRecord",
    "conversation_id",
    "detect_layout",
    "link_tool_calls",
    "normalize",
    "parse",
    "prompt_messages",
    "recorded_conversations",
]
