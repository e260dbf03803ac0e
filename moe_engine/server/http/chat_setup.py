"""The chat settings of a server from its flags and checkpoint (`ChatSettings`).

`--tool-call-parser` and `--reasoning-parser` take a parser name of `parsers.registry` or
`none` (no parser); unset, each is the checkpoint's default (`registry.default_parsers`: the
chat template's markers, then `config.json`'s architecture). Unknown names are refused when the
options are built, before the model loads, with the valid names listed. `--chat-template` is a
file's path or the template itself (`chat_render.load_chat_template`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from moe_engine.server.http.chat_render import load_chat_template

__all__ = ["chat_settings", "check_parser_names", "load_chat_template"]
from moe_engine.server.http.state import ChatSettings
from moe_engine.server.parsers.registry import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    default_parsers,
    needs_special_tokens,
)

logger = logging.getLogger(__name__)

#: The parser name that turns a parser off (`--reasoning-parser none`).
NO_PARSER = "none"


def check_parser_names(tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """Refuse an unknown parser name.

    Raises:
        ValueError: naming the flag, the value and the valid names.
    """
    for flag, name, known in (("--tool-call-parser", tool_call_parser, TOOL_PARSERS),
                              ("--reasoning-parser", reasoning_parser, REASONING_PARSERS)):
        if name is not None and name != NO_PARSER and name not in known:
            valid = ", ".join([*sorted(known), NO_PARSER])
            raise ValueError(f"{flag}: unknown parser {name!r}; choose one of {valid}")


def architecture(model_dir: str) -> str:
    """`config.json`'s `architectures[0]` in `model_dir`, or "" when it cannot be read."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
        return str((config.get("architectures") or [""])[0])
    except (OSError, ValueError, AttributeError):
        return ""


def chat_settings(
    *, chat_template: str | None, tool_call_parser: str | None, reasoning_parser: str | None,
    enable_auto_tool_choice: bool, tokenizer: Any, model_dir: str,
) -> ChatSettings:
    """The settings the flags give for this checkpoint (defaults filled in and logged).

    Raises:
        ValueError: an unknown parser name, or a `--chat-template` file that cannot be read.
    """
    check_parser_names(tool_call_parser, reasoning_parser)
    template = load_chat_template(chat_template)
    source = template or getattr(tokenizer, "chat_template", None)
    if not isinstance(source, str):
        source = None  # a dict of named templates: the default pick reads none of them
    tool, reasoning = default_parsers(architecture(model_dir), source)
    if tool_call_parser is not None:
        tool = None if tool_call_parser == NO_PARSER else tool_call_parser
    if reasoning_parser is not None:
        reasoning = None if reasoning_parser == NO_PARSER else reasoning_parser
    logger.info("chat: tool-call parser %s%s, reasoning parser %s, chat template %s",
                tool or "none", "" if enable_auto_tool_choice or tool is None
                else " (tool_choice auto off: --enable-auto-tool-choice)", reasoning or "none",
                "--chat-template" if template else "the tokenizer's")
    return ChatSettings(template, tool, reasoning, enable_auto_tool_choice,
                        reasoning_keeps_special_tokens(reasoning, tokenizer))


def reasoning_keeps_special_tokens(reasoning: str | None, tokenizer: Any) -> bool:
    """Whether the reasoning parser's output must keep special tokens: the parser says so, or
    one of its markers is a special token of `tokenizer` (it would vanish from the text with
    `skip_special_tokens=True`); `registry.needs_special_tokens` decides."""
    if reasoning is None:
        return False
    return needs_special_tokens(reasoning, None, special_tokens(tokenizer))


def special_tokens(tokenizer: Any) -> set[str]:
    """The tokenizer's special tokens: `all_special_tokens` and the added tokens marked
    special (empty without a tokenizer)."""
    out = set(getattr(tokenizer, "all_special_tokens", None) or ())
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    out.update(t.content for t in decoder.values() if getattr(t, "special", False))
    return out
