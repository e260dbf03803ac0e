"""gpt-oss's harmony format, read from text: reasoning (`openai_gptoss`) and tool calls (`openai`).

Format (OpenAI's "Harmony response format", github.com/openai/harmony `docs/format.md`, also
cookbook.openai.com/articles/openai-harmony): a message is
`<|start|>{header}<|message|>{content}` ended by `<|end|>`, `<|call|>` (a tool call, stop) or
`<|return|>` (done, stop). The header is the role then `<|channel|>` and the channel; a
recipient `to=functions.NAME` may sit in the role part or after the channel, and
`<|constrain|>json` may follow it. The prompt ends with `<|start|>assistant`, so the output's
first message starts at `<|channel|>`:

    <|channel|>analysis<|message|>User asks ...<|end|>
    <|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>

    <|channel|>analysis<|message|>Need weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"location":"SF"}<|call|>

(one line each; broken here for width). Channels: `analysis` is the chain of thought
(reasoning; built-in tools `to=python` /
`to=browser.*` are called there too), `final` is the answer, `commentary` carries function
calls (with a recipient) and preambles shown to the user (without one). vLLM reads them the
same way (`vllm/entrypoints/harmony_utils.py` `parse_chat_output`: analysis -> reasoning,
final and recipient-less commentary -> content joined by "\\n"; `openai_tool_parser.py`:
recipient `functions.*` -> a call, the message body as its arguments).

Why text and not the `openai-harmony` library: its `StreamableParser` reads o200k_harmony token
ids and `load_harmony_encoding` downloads the o200k vocabulary (hash-checked) on first use, so it
cannot start offline and cannot read the small test vocabularies; the format's markers are
plain text once the detokenizer keeps special tokens (`skip_special_tokens=False`, which this
family needs: `needs_special_tokens`).

Roles in `OutputStream(reasoning=HarmonyReasoningParser, tools=HarmonyToolParser)`: the
reasoning parser sends analysis bodies as reasoning and, as content, the visible bodies (final,
preambles) as plain text with every call message kept verbatim (its markup, as other families'
reasoning parsers leave `<tool_call>` text in the content); the tool parser takes the calls out
of that. Either parser also reads the raw output alone (the tool parser then drops analysis).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from moe_engine.server.parsers.base import (
    ParsedCalls,
    ParsedReasoning,
    PartialCall,
    ReasoningParser,
    ToolParser,
)
from moe_engine.server.parsers.markers import without_held

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
TERMINATORS = ("<|end|>", "<|call|>", "<|return|>")
#: What begins a message header outside a message.
HEADER_STARTS = (START, CHANNEL)
#: What ends a message body: its terminator, or (malformed) the next header.
BODY_STOPS = (*TERMINATORS, START, CHANNEL)
_RECIPIENT = re.compile(r"(?:^|\s)to=(\S+)")
_FUNCTIONS = "functions."


@dataclass
class HarmonyMessage:
    """One message as far as the text shows it.

    Attributes:
        channel: `analysis`, `final`, `commentary`, or None when the header names none.
        recipient: the `to=` target (`functions.get_weather`, `python`), or None.
        body: the content so far, certain (a partial end marker is held back).
        start / stop: the message's span in the text, header to terminator (stop excludes what
            is held back), for sending a call message on verbatim.
        complete: its terminator (or the next header) was seen, or the text is final.
    """

    channel: str | None
    recipient: str | None
    body: str
    start: int
    stop: int
    complete: bool

    @property
    def call_name(self) -> str | None:
        """The function's name when this message calls one (`to=functions.NAME`), else None."""
        if self.recipient and self.recipient.startswith(_FUNCTIONS):
            return self.recipient[len(_FUNCTIONS):] or None
        return None

    @property
    def visible(self) -> bool:
        """Shown to the user: the final channel, a recipient-less preamble, or no channel."""
        return self.recipient is None and self.channel in ("final", "commentary", None)


def _parse_header(header: str) -> tuple[str | None, str | None]:
    """(channel, recipient) from a header's text (between the message start and `<|message|>`).

    The recipient (`to=NAME`) may stand in the role part or the channel part; the channel is
    the first other word after `<|channel|>`; `<|constrain|>TYPE` is not needed here.
    """
    flat = header.replace(START, " ").replace(CONSTRAIN, " ")
    match = _RECIPIENT.search(flat.replace(CHANNEL, " "))
    recipient = match.group(1) if match else None
    _, has_channel, channel_part = flat.partition(CHANNEL)
    words = [w for w in channel_part.split() if not w.startswith("to=")] if has_channel else []
    return (words[0] if words else None), recipient


def scan(text: str, final: bool, open_analysis: bool = False) -> list[str | HarmonyMessage]:
    """Split harmony output into plain-text runs and messages, certain parts only.

    Args:
        text: the output so far, special tokens kept.
        final: the text is complete: nothing is held back, an unfinished message is complete
            and an unfinished header is plain text.
        open_analysis: the prompt ended inside an analysis message's body.

    Returns:
        Plain strings (text outside any message: malformed output, kept for the user) and
        `HarmonyMessage`s, in order; a header not yet closed by `<|message|>` is held back.
    """
    items: list[str | HarmonyMessage] = []
    pos = 0
    if open_analysis:
        pos = _read_body(text, 0, 0, ("analysis", None), final, items)
    while pos < len(text):
        head, _ = _next_marker(text, pos, HEADER_STARTS)
        if head < 0:
            plain = without_held(text[pos:], HEADER_STARTS, final)
            if plain:
                items.append(plain)
            break
        if head > pos:
            items.append(text[pos:head])
        pos = _read_message(text, head, final, items)
    return items


def _next_marker(text: str, pos: int, markers: tuple[str, ...]) -> tuple[int, str]:
    """(index, marker) of the first of `markers` at or after `pos`, or (-1, ""). Every harmony
    marker starts with `<|`, so one pass over the `<|` occurrences finds it."""
    at = text.find("<|", pos)
    while at >= 0:
        for marker in markers:
            if text.startswith(marker, at):
                return at, marker
        at = text.find("<|", at + 2)
    return -1, ""


def _read_message(text: str, head: int, final: bool, items: list) -> int:
    """Read the message whose header starts at `head`; returns where scanning goes on."""
    opener = START if text.startswith(START, head) else CHANNEL
    # A `<|channel|>` belongs in a header opened by `<|start|>`; any other marker before
    # `<|message|>` breaks the header.
    breakers = (*TERMINATORS, START) if opener == START else BODY_STOPS
    at, marker = _next_marker(text, head + len(opener), (MESSAGE, *breakers))
    if at < 0:
        if final:
            items.append(text[head:])
        return len(text)  # hold the unfinished header back
    if marker != MESSAGE:
        items.append(text[head:at])  # a broken header is plain text, never dropped
        return at
    header = _parse_header(text[head:at])
    return _read_body(text, head, at + len(MESSAGE), header, final, items)


def _read_body(text: str, head: int, begin: int, header: tuple[str | None, str | None],
               final: bool, items: list) -> int:
    """Read a body from `begin` to its terminator; append the message; return the next pos."""
    channel, recipient = header
    at, marker = _next_marker(text, begin, BODY_STOPS)
    if at >= 0:
        stop = at + len(marker) if marker in TERMINATORS else at
        items.append(HarmonyMessage(channel, recipient, text[begin:at], head, stop, True))
        return stop
    body = without_held(text[begin:], BODY_STOPS, final)
    items.append(HarmonyMessage(channel, recipient, body, head, begin + len(body), final))
    return len(text)


def _verbatim(text: str, message: HarmonyMessage) -> str:
    """A message's markup as written; one that ended without a terminator (the next header
    began, or the output was cut) gets `<|end|>`, so a reader of the markup alone sees it end."""
    raw = text[message.start:message.stop]
    if message.complete and not raw.endswith(TERMINATORS):
        raw += TERMINATORS[0]
    return raw


class HarmonyReasoningParser(ReasoningParser):
    """gpt-oss reasoning (vLLM's `--reasoning-parser openai_gptoss`): analysis -> reasoning.

    Content is the visible text (final and preamble bodies, joined by "\\n" as vLLM joins them)
    with call messages kept verbatim for `HarmonyToolParser`. `starts_in_reasoning`: the
    prompt ended inside an analysis message (a continued final message).
    """

    name: ClassVar[str] = "openai_gptoss"
    needs_special_tokens: ClassVar[bool] = True

    def parse(self, text: str, final: bool) -> ParsedReasoning:
        reasoning: list[str] = []
        content: list[str] = []
        shown = 0
        items = scan(text, final, open_analysis=self.starts_in_reasoning)
        for item in items:
            if isinstance(item, str):
                content.append(item)
            elif item.call_name is None and item.channel == "analysis":
                reasoning.append(item.body)
            elif item.visible:
                content.append(("\n" if shown else "") + item.body)
                shown += 1
            else:
                content.append(_verbatim(text, item))
        last = items[-1] if items else None
        thinking = isinstance(last, HarmonyMessage) and last.channel == "analysis" \
            and last.call_name is None
        ended = final if last is None else not thinking
        return ParsedReasoning("\n".join(reasoning), "".join(content), ended)

    @classmethod
    def prompt_opens_reasoning(cls, prompt_text: str) -> bool:
        """Whether the prompt ends inside an analysis message (header closed, no terminator)."""
        head = prompt_text.rfind(START)
        tail = prompt_text[head:] if head >= 0 else prompt_text
        if MESSAGE not in tail or any(m in tail for m in TERMINATORS):
            return False
        channel, recipient = _parse_header(tail.partition(MESSAGE)[0])
        return channel == "analysis" and recipient is None


class HarmonyToolParser(ToolParser):
    """gpt-oss function calls (vLLM's `--tool-call-parser openai`).

    Reads the reasoning parser's content (plain text plus verbatim call messages) or the raw
    output: each message to `functions.NAME` is a call whose arguments are its body (the JSON
    text as the model wrote it, sent as it grows; invalid JSON is passed on, as vLLM does);
    visible messages are content; analysis messages are dropped (they are reasoning, not for
    the user); a message to any other recipient stays in the content verbatim. Harmony calls
    carry no id (the stream makes one).
    """

    name: ClassVar[str] = "openai"
    needs_special_tokens: ClassVar[bool] = True

    def parse(self, text: str, final: bool) -> ParsedCalls:
        content: list[str] = []
        calls: list[PartialCall] = []
        shown = 0
        for item in scan(text, final):
            if isinstance(item, str):
                content.append(item)
            elif item.call_name is not None:
                calls.append(PartialCall(item.call_name, item.body, item.complete))
            elif item.channel == "analysis":
                continue
            elif item.visible:
                content.append(("\n" if shown else "") + item.body)
                shown += 1
            else:
                content.append(_verbatim(text, item))
        return ParsedCalls("".join(content), calls)


__all__ = ["HarmonyMessage", "HarmonyReasoningParser", "HarmonyToolParser", "scan"]
