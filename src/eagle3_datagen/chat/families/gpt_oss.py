"""gpt-oss (20b, 120b): OpenAI's harmony format.

The template builds its own system message (model identity, knowledge cutoff, today's date through
`strftime_now`, `Reasoning: {reasoning_effort}`) and turns the user's system prompt into a developer
message. A turn is a run of assistant messages after `<|start|>assistant`: reasoning in the analysis
channel (`<|channel|>analysis<|message|>...<|end|>`), then either the answer in the final channel,
ended `<|return|>` where it closes the conversation and `<|end|>` in a history (whose analysis is
dropped), or one tool call (`to=functions.NAME ... <|message|>{arguments}<|call|>`, arguments written
with `tojson`), whose analysis a history keeps until the chain's final answer. The reasoning is read
from the message's `thinking` field, whose mere presence renders an analysis message.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from eagle3_datagen.chat.families.base import Family, register
from eagle3_datagen.chat.template import ParsedOutput, SpecialTokens

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ASSISTANT_START = "<|start|>assistant"
# One harmony message: header (role and recipient, channel, constraint), body, its end (none: cut off).
MESSAGE = re.compile(
    r"<\|start\|>(?P<role>[^<]*)<\|channel\|>(?P<channel>[^<]*)(?:<\|constrain\|>(?P<constrain>[^<]*))?"
    r"<\|message\|>(?P<body>.*?)(?P<end><\|end\|>|<\|return\|>|<\|call\|>|$)",
    re.DOTALL,
)
RECIPIENT = re.compile(r"\bto=functions\.(?P<name>\S+)")


@register("gpt-oss")
class GptOss(Family):
    title = "gpt-oss (20b, 120b): harmony channels"
    signature = ("<|start|>assistant", "<|channel|>", "<|return|>", "<|call|>")
    model_types = ("gpt_oss",)
    thinking_switch = "reasoning_effort"
    reasoning_field = "thinking"
    reasoning_when_empty = False
    tool_arguments = "object"
    parallel_tool_calls = False  # the template renders a turn's first call only
    turn_ends = ("<|end|>", "<|call|>")
    turn_continues = ASSISTANT_START
    stop_tokens = ("<|call|>",)

    def tool_call_parser(self, tokenizer: PreTrainedTokenizerBase, template_kwargs: dict | None) -> None:
        return None  # calls are messages of their own: `parse_output` reads them

    def parse_output(
        self,
        tokenizer: PreTrainedTokenizerBase,
        output_ids: Sequence[int],
        specials: SpecialTokens,
        prompt_ids: Sequence[int] = (),
    ) -> ParsedOutput:
        """The messages generated after `<|start|>assistant`, as SGLang's harmony parsers read them:
        the analysis is the reasoning, the final message the content, a commentary message to
        `functions.NAME` a call. Well formed: at most one analysis, then one final answer ended
        `<|return|>` or one call ended `<|call|>` (what the template renders back); a message ended
        `<|end|>` is followed by another."""
        ids = list(output_ids)
        stopped = bool(ids) and ids[-1] in specials.stop_ids
        text = ASSISTANT_START + tokenizer.decode(ids, skip_special_tokens=False)
        messages, at = [], 0
        while at < len(text):
            match = MESSAGE.match(text, at)
            if match is None or match.end() == at:
                return ParsedOutput("", text[len(ASSISTANT_START) :], stopped, False)
            messages.append(match)
            at = match.end()
        reasoning, content, calls, well_formed = "", "", None, True
        for n, message in enumerate(messages):
            last = n == len(messages) - 1
            channel = message["channel"].split()[0] if message["channel"].split() else ""
            recipient = RECIPIENT.search(message["role"] + " " + message["channel"])
            ended = message["end"]
            if channel == "analysis" and recipient is None and n == 0 and not last and ended == "<|end|>":
                reasoning = message["body"]
            elif channel == "final" and recipient is None and last and ended in ("<|return|>", ""):
                content = message["body"]
            elif channel == "commentary" and recipient and last and ended in ("<|call|>", ""):
                calls = [(recipient["name"], message["body"])]
            else:
                well_formed = False
        return ParsedOutput(reasoning, content, stopped, well_formed, calls)
