"""Parser names (vLLM's `--tool-call-parser` / `--reasoning-parser` names) and the default pick.

`REASONING_PARSERS` and `TOOL_PARSERS` map a name to its class; `tool_parser` and
`reasoning_parser` build one per request choice, refusing unknown names with the valid ones
listed. `default_parsers(architecture, chat_template)` picks both from the checkpoint when the
flags are not given: the chat template's markers first (they show the format the model was
trained on), the architecture as the tie-breaker when the template shows none.

Chat-template markers (first match wins; formats as the family's template writes them):

| marker(s) in the template                            | tool parser    |
|------------------------------------------------------|----------------|
| `<tool_call>` and `<function=` (Qwen3-Coder XML)     | `qwen3_coder`  |
| `<tool_call>` and `<arg_key>` (GLM-4.5 / 4.6)        | `glm45`        |
| `<tool_call>` (Hermes / Qwen3 JSON)                  | `hermes`       |
| `<｜tool▁calls▁begin｜>` and `` ```json `` or        | `deepseek_v3`  |
|   `function<｜tool▁sep｜>` (DeepSeek-V3 / R1)        |                |
| `<｜tool▁calls▁begin｜>` otherwise (DeepSeek-V3.1)   | `deepseek_v31` |
| `<|tool_calls_section_begin|>` (Kimi-K2)             | `kimi_k2`      |
| `<|channel|>` (gpt-oss harmony)                      | `openai`       |

| marker(s) in the template                            | reasoning parser |
|------------------------------------------------------|------------------|
| `<|channel|>` (gpt-oss harmony)                      | `openai_gptoss`  |
| `<think>` and `<|im_assistant|>` (Kimi-K2-Thinking)  | `kimi_k2`        |
| `<think>`, `<｜Assistant｜>`, a `thinking` kwarg      | `deepseek_v31`   |
| `<think>` and `<｜Assistant｜>` (DeepSeek-R1)         | `deepseek_r1`    |
| `<think>` and `<|assistant|>` (GLM-4.5)              | `glm45`          |
| `<think>` and `<|im_start|>` (Qwen3), other `<think>`| `qwen3`          |

Architecture tie-breaker (`ARCHITECTURE_DEFAULTS`), for a role the template leaves open (or
when there is no template):

| architecture (config.json) | tool parser   | reasoning parser |
|----------------------------|---------------|------------------|
| `DeepseekV3ForCausalLM`    | `deepseek_v3` | none (1)         |
| `Qwen3MoeForCausalLM`      | `hermes`      | `qwen3` (2)      |
| `Qwen3NextForCausalLM`     | `hermes`      | `qwen3` (2)      |
| `Glm4MoeForCausalLM`       | `glm45`       | `glm45` (2)      |
| `GptOssForCausalLM`        | `openai`      | `openai_gptoss`  |

(1) DeepSeek-R1, V3.1 and Kimi-K2 share this architecture and are told apart only by their
templates; `deepseek_r1` would read all of V3's output as reasoning. (2) These parsers reason
only when the output (or the prompt) opens `<think>`, so a non-thinking checkpoint is unharmed.

Sources: the families' chat templates (as copied in llama.cpp's `models/templates/`), vLLM's
parser modules of the same names; see each parser module's docstring.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

from moe_engine.server.parsers.base import ReasoningParser, ToolParser
from moe_engine.server.parsers.harmony import HarmonyReasoningParser, HarmonyToolParser
from moe_engine.server.parsers.reasoning_think import (
    DeepSeekR1ReasoningParser,
    DeepSeekV31ReasoningParser,
    Glm45ReasoningParser,
    KimiK2ReasoningParser,
    Qwen3ReasoningParser,
)
from moe_engine.server.parsers.tools import TOOL_PARSERS as _FAMILY_TOOL_PARSERS

#: `--reasoning-parser` name -> class.
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls
    for cls in (
        DeepSeekR1ReasoningParser,
        DeepSeekV31ReasoningParser,
        Qwen3ReasoningParser,
        Glm45ReasoningParser,
        KimiK2ReasoningParser,
        HarmonyReasoningParser,
    )
}

#: `--tool-call-parser` name -> class: the families' parsers (`tools.py`) and gpt-oss's.
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    **_FAMILY_TOOL_PARSERS,
    HarmonyToolParser.name: HarmonyToolParser,
}

#: architecture -> (tool parser, reasoning parser), the tie-breaker of `default_parsers`.
ARCHITECTURE_DEFAULTS: dict[str, tuple[str | None, str | None]] = {
    "DeepseekV3ForCausalLM": ("deepseek_v3", None),
    "Qwen3MoeForCausalLM": ("hermes", "qwen3"),
    "Qwen3NextForCausalLM": ("hermes", "qwen3"),
    "Glm4MoeForCausalLM": ("glm45", "glm45"),
    "GptOssForCausalLM": ("openai", "openai_gptoss"),
}

_DS_CALLS, _DS_SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>"
_THINKING_KWARG = re.compile(r"(?<![\w.])thinking(?!\w)")


def _choose(flag: str, name: str, known: dict[str, Any]) -> Any:
    """The class named `name`, or ValueError naming the flag and the valid names."""
    try:
        return known[name]
    except KeyError:
        valid = ", ".join(sorted(known))
        raise ValueError(f"{flag}: unknown name {name!r}; choose from {valid}") from None


def tool_parser(name: str, tools: list[dict[str, Any]] | None = None) -> ToolParser:
    """A fresh tool parser for one choice of one request.

    Args:
        name: a `--tool-call-parser` name (a key of `TOOL_PARSERS`).
        tools: the request's `tools`, for formats that need the parameters' types.

    Raises:
        ValueError: unknown name (the message lists the valid ones).
    """
    return _choose("--tool-call-parser", name, TOOL_PARSERS)(tools)


def starts_in_reasoning(prompt_text: str, parser_name: str) -> bool:
    """Whether the rendered prompt leaves the output inside the family's reasoning block.

    Args:
        prompt_text: the chat template's output for this request (generation prompt included).
        parser_name: a `--reasoning-parser` name.

    Raises:
        ValueError: unknown name.
    """
    cls = _choose("--reasoning-parser", parser_name, REASONING_PARSERS)
    opens = getattr(cls, "prompt_opens_reasoning", None)
    return bool(opens(prompt_text)) if opens is not None else False


def reasoning_parser(name: str, prompt_text: str = "") -> ReasoningParser:
    """A fresh reasoning parser for one choice of one request, started where the prompt left it.

    Args:
        name: a `--reasoning-parser` name (a key of `REASONING_PARSERS`).
        prompt_text: the rendered prompt (see `starts_in_reasoning`); "" reads as a prompt that
            pre-filled nothing (the family's default).

    Raises:
        ValueError: unknown name (the message lists the valid ones).
    """
    cls = _choose("--reasoning-parser", name, REASONING_PARSERS)
    return cls(starts_in_reasoning=starts_in_reasoning(prompt_text, name))


def needs_special_tokens(reasoning_name: str | None, tool_name: str | None,
                         special_tokens: Collection[str] = ()) -> bool:
    """Whether the chosen parsers need special tokens kept in the detokenized text
    (`skip_special_tokens=False`).

    Args:
        reasoning_name / tool_name: the chosen parsers' names, or None.
        special_tokens: this tokenizer's special tokens (transformers' `all_special_tokens`
            plus the added tokens marked `special`); a think parser needs them kept when one
            of its markers is among them (Qwen3's and DeepSeek-R1's `<think>` are not special;
            other checkpoints may mark it so).

    Returns:
        True for gpt-oss's harmony parsers (their markers are special tokens in every
        vocabulary), or when a reasoning parser's markers are in `special_tokens`.
    """
    chosen = (REASONING_PARSERS.get(reasoning_name or ""), TOOL_PARSERS.get(tool_name or ""))
    if any(getattr(cls, "needs_special_tokens", False) for cls in chosen):
        return True
    markers_of = getattr(chosen[0], "markers", None)
    markers = markers_of() if markers_of is not None else ()
    return any(m in special_tokens for m in markers)


def _tool_from_template(template: str) -> str | None:
    if "<tool_call>" in template:
        if "<function=" in template:
            return "qwen3_coder"
        return "glm45" if "<arg_key>" in template else "hermes"
    if _DS_CALLS in template:
        v3 = "```json" in template or f"function{_DS_SEP}" in template
        return "deepseek_v3" if v3 else "deepseek_v31"
    if "<|tool_calls_section_begin|>" in template:
        return "kimi_k2"
    if "<|channel|>" in template:
        return "openai"
    return None


def _reasoning_from_template(template: str) -> str | None:
    if "<|channel|>" in template:
        return "openai_gptoss"
    if "<think>" not in template:
        return None
    if "<|im_assistant|>" in template:
        return "kimi_k2"
    if "<｜Assistant｜>" in template:
        return "deepseek_v31" if _THINKING_KWARG.search(template) else "deepseek_r1"
    if "<|assistant|>" in template:
        return "glm45"
    return "qwen3"


def default_parsers(architecture: str, chat_template: str | None) -> tuple[str | None, str | None]:
    """(tool parser name, reasoning parser name) for a checkpoint; None where none fits.

    Args:
        architecture: `config.json`'s `architectures[0]` (`DeepseekV3ForCausalLM`).
        chat_template: the Jinja source the server renders prompts with, or None.

    The template's markers decide each role (module docstring); the architecture's row of
    `ARCHITECTURE_DEFAULTS` fills a role the template leaves open.
    """
    template = chat_template or ""
    arch_tool, arch_reasoning = ARCHITECTURE_DEFAULTS.get(architecture, (None, None))
    tool = _tool_from_template(template) or arch_tool
    reasoning = _reasoning_from_template(template) or arch_reasoning
    return tool, reasoning
