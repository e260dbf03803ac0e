"""Reasoning in a `<think>...</think>` block: DeepSeek-R1, DeepSeek-V3.1, Qwen3, GLM-4.5, Kimi-K2.

One parser, `ThinkReasoningParser`, reads every family whose reasoning is a think block; the
named subclasses only set the family's markers and defaults (the names of vLLM's
`--reasoning-parser`). Sources, read December 2026:

- DeepSeek-R1: the chat template ends the generation prompt with `<｜Assistant｜><think>\\n`
  (deepseek-ai/DeepSeek-R1 `tokenizer_config.json`, as copied in llama.cpp's
  `models/templates/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja`), so the output starts
  inside the block and holds only `</think>`; vLLM's `deepseek_r1_reasoning_parser.py` reads
  output without `<think>` as reasoning and strips a `<think>` the model writes itself.
- DeepSeek-V3.1: the template ends the prompt with `<｜Assistant｜><think>` when its `thinking`
  kwarg is true and with `<｜Assistant｜></think>` otherwise (llama.cpp's
  `deepseek-ai-DeepSeek-V3.1.jinja`); vLLM's `deepseek_v31_reasoning_parser.py` reasons only
  when `chat_template_kwargs.thinking` is true. Here the rendered prompt decides (same result).
- Qwen3: the model writes `<think>...</think>`; with `enable_thinking=False` the template
  pre-fills `<think>\\n\\n</think>\\n\\n` after `<|im_start|>assistant\\n` (Qwen/Qwen3-8B
  `tokenizer_config.json`; Hugging Face blog "The 4 Things Qwen-3's Chat Template Teaches Us"),
  and Qwen3-2507 Thinking / Qwen3.5 templates put `<think>\\n` in the prompt (vLLM's
  `qwen3_reasoning_parser.py`).
- GLM-4.5: the model writes `\\n<think>...</think>` after `<|assistant|>`; with
  `enable_thinking=False` the template pre-fills `<|assistant|>\\n<think></think>` (llama.cpp's
  `models/templates/glm_4_5.jinja`; vLLM's `glm4_moe_reasoning_parser.py`).
- Kimi-K2-Thinking: the prompt ends `<|im_assistant|>assistant<|im_middle|>` and the model
  writes `<think>...</think>`; earlier assistant turns are rendered with their own think blocks
  (llama.cpp's `moonshotai-Kimi-K2-Thinking.jinja`). vLLM's `kimi_k2_reasoning_parser.py`
  reads output without `<think>` as reasoning and ends reasoning early at
  `<|tool_calls_section_begin|>` (a tool-call section that opens without `</think>`).

Semantics (one rule for every family, so streamed == whole): the output is inside the block
from its first character when `starts_in_reasoning` (the prompt opened it), or when it begins
(after whitespace) with `<think>`, which is then dropped; reasoning runs to `</think>` (dropped)
or to an implicit end marker (kept, it starts the content); everything after is content, sent
on as it is (vLLM keeps the newlines after `</think>` too). Output that never opens a block is
all content. A reasoning block cut off by the length limit is all reasoning (`ended` False).
The markers must survive detokenization: `<think>` and `</think>` are added tokens not marked
special in DeepSeek-R1's and Qwen3's vocabularies, so `skip_special_tokens` may stay True there;
where a checkpoint's vocabulary marks one of a parser's markers special,
`registry.needs_special_tokens(..., special_tokens)` says to keep special tokens.
"""

from __future__ import annotations

from typing import ClassVar

from moe_engine.server.parsers.base import ParsedReasoning, ReasoningParser
from moe_engine.server.parsers.markers import without_held


class ThinkReasoningParser(ReasoningParser):
    """Splits output at a think block; the family's markers and defaults are class attributes.

    Args:
        starts_in_reasoning: the rendered prompt left the output inside the block (see
            `prompt_opens_reasoning`).

    Class attributes (what a family subclass sets):
        start_marker / end_marker: the block's markers (`<think>`, `</think>`).
        implicit_ends: markers that end reasoning without `end_marker` and begin the content
            (kept in it, for the tool parser).
        assistant_markers: where the family's assistant turn begins in a rendered prompt; the
            text after the last one is what the template pre-filled for this output.
        opens_by_default: the output starts inside the block when the pre-filled tail shows
            neither marker (the family always reasons, as vLLM reads DeepSeek-R1 and Kimi-K2).
    """

    name: ClassVar[str] = "think"
    start_marker: ClassVar[str] = "<think>"
    end_marker: ClassVar[str] = "</think>"
    implicit_ends: ClassVar[tuple[str, ...]] = ()
    assistant_markers: ClassVar[tuple[str, ...]] = ()
    opens_by_default: ClassVar[bool] = False
    #: True would mean: keep special tokens whatever the vocabulary (see `markers`).
    needs_special_tokens: ClassVar[bool] = False

    @classmethod
    def markers(cls) -> tuple[str, ...]:
        """Every marker this parser reads (to check against a tokenizer's special tokens)."""
        return (cls.start_marker, cls.end_marker, *cls.implicit_ends)

    def parse(self, text: str, final: bool) -> ParsedReasoning:
        """Read the whole output so far; see the module docstring for the rule."""
        lead = 0
        while lead < len(text) and text[lead].isspace():
            lead += 1
        if text.startswith(self.start_marker, lead):
            return self._read_block(text, lead + len(self.start_marker), final)
        if not final and self.start_marker.startswith(text[lead:lead + len(self.start_marker)]):
            return ParsedReasoning("", "", False)  # whitespace or a partial `<think>` so far
        if self.starts_in_reasoning:
            return self._read_block(text, 0, final)
        return ParsedReasoning("", text, True)

    def _read_block(self, text: str, begin: int, final: bool) -> ParsedReasoning:
        """The block's body from `begin` to its end marker; content after it."""
        cut = resume = text.find(self.end_marker, begin)
        if cut >= 0:
            resume = cut + len(self.end_marker)
        for marker in self.implicit_ends:
            at = text.find(marker, begin)
            if at >= 0 and (cut < 0 or at < cut):
                cut = resume = at
        if cut >= 0:
            return ParsedReasoning(text[begin:cut], text[resume:], True)
        body = without_held(text[begin:], (self.end_marker, *self.implicit_ends), final)
        return ParsedReasoning(body, "", False)

    @classmethod
    def prompt_opens_reasoning(cls, prompt_text: str) -> bool:
        """Whether the rendered prompt leaves this family's output inside a think block.

        Reads the prompt's tail after the last assistant-turn marker (earlier turns carry their
        own closed blocks): an open `<think>` there means True (DeepSeek-R1, V3.1 thinking,
        Qwen3-2507 Thinking, a continued final message); a `</think>` after it means False (a
        pre-filled empty block: Qwen3 and GLM-4.5 with `enable_thinking=False`, V3.1 without
        `thinking`); neither means the family's `opens_by_default`. Without any assistant
        marker only the prompt's very end (less whitespace) is read.
        """
        cut = max((prompt_text.rfind(m) for m in cls.assistant_markers), default=-1)
        if cut < 0:
            tail = prompt_text.rstrip()
            if tail.endswith(cls.start_marker):
                return True
            if tail.endswith(cls.end_marker):
                return False
            return cls.opens_by_default
        tail = prompt_text[cut:]
        opened, closed = tail.rfind(cls.start_marker), tail.rfind(cls.end_marker)
        if opened > closed:
            return True
        if closed >= 0:
            return False
        return cls.opens_by_default


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """DeepSeek-R1 (and its distills): the template opens the block; always reasons."""

    name = "deepseek_r1"
    assistant_markers = ("<｜Assistant｜>",)
    opens_by_default = True


class DeepSeekV31ReasoningParser(ThinkReasoningParser):
    """DeepSeek-V3.1: reasons only when the template's `thinking` kwarg opened the block."""

    name = "deepseek_v31"
    assistant_markers = ("<｜Assistant｜>",)


class Qwen3ReasoningParser(ThinkReasoningParser):
    """Qwen3: the model opens the block (or a 2507-Thinking / Qwen3.5 template does)."""

    name = "qwen3"
    assistant_markers = ("<|im_start|>assistant",)


class Glm45ReasoningParser(ThinkReasoningParser):
    """GLM-4.5 / 4.6: the model opens the block after `<|assistant|>`."""

    name = "glm45"
    assistant_markers = ("<|assistant|>",)


class KimiK2ReasoningParser(ThinkReasoningParser):
    """Kimi-K2-Thinking: always reasons; a tool-call section also ends the reasoning."""

    name = "kimi_k2"
    implicit_ends = ("<|tool_calls_section_begin|>",)
    assistant_markers = ("<|im_assistant|>",)
    opens_by_default = True
