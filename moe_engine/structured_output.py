"""Structured output: JSON schemas (and any JSON object) as a token bitmask per step.

The grammar library is xgrammar (Dong et al., "XGrammar: Flexible and Efficient Structured
Generation Engine for Large Language Models", 2024), as vLLM v1 and SGLang use it:

- `StructuredOutputManager.grammar_for` compiles a request's schema when the request is added
  (`EngineCore.add_request`); a schema xgrammar refuses is a RequestError naming
  "response_format" before anything is queued. Compiled grammars are cached by schema text in
  xgrammar's compiler cache (bounded by GRAMMAR_CACHE_BYTES). The tokenizer's `TokenizerInfo`
  and the compiler are built on the first such request, so an engine that never sees one pays
  nothing at startup.
- Each completion owns one `RequestGrammar` (an xgrammar `GrammarMatcher`): `Request.
  append_token` advances it with every sampled token; once it is terminated (the JSON is
  complete and it accepted EOS) the request finishes with "stop".
- `GrammarBitmask.apply` masks, in place, the logits rows of the requests that have a grammar
  (one bitmask buffer of [max_num_seqs, ceil(vocab_size / 32)] int32, allocated once, filled
  per row); the other rows are untouched. The sampler applies it first, so temperature, top-k,
  top-p and the returned logprobs all see the constrained distribution (vLLM v1 applies its
  grammar bitmask to the logits before its sampler the same way).

Outputs are compact JSON (no whitespace between tokens of the JSON: `any_whitespace=False`,
separators "," and ":"), which keeps a model from spending its max_tokens on whitespace.
Compact JSON never holds a byte below 0x20 (RFC 8259 section 7: control characters inside
strings must be escaped), yet xgrammar 0.2.9's string rule lets some through (a raw
backspace, which `json.loads` refuses); so every grammar row's bitmask is also ANDed with a
fixed mask of the tokens free of such bytes (`no_control_bytes_bitmask`).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from moe_engine.errors import ErrorCode, RequestError
from moe_engine.request import Request
from moe_engine.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

#: Bound on xgrammar's compiled-grammar cache (bytes of compiled grammars kept).
GRAMMAR_CACHE_BYTES = 128 * 1024 * 1024
#: The schema of `json_object`: any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
#: How compact outputs are laid out (`GrammarCompiler.compile_json_schema` arguments).
_JSON_LAYOUT = dict(any_whitespace=False, separators=(",", ":"))
#: xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:NNN: " and sometimes a check.
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: .*? is false:\s*)?")


class RequestGrammar:
    """One completion's grammar state (an xgrammar `GrammarMatcher`).

    Args:
        matcher: a fresh matcher of the request's compiled grammar.
        allowed_words: [ceil(V / 32)] int32, a fixed bitmask ANDed into every step's (None:
            none).
    """

    def __init__(self, matcher: Any, allowed_words: torch.Tensor | None = None) -> None:
        self.matcher = matcher
        self.allowed_words = allowed_words
        self.refused = False

    def accept(self, token_id: int) -> None:
        """Advance by one sampled token. A token the grammar refuses (only a bug lets one
        through the bitmask) is logged and ends the request (`is_terminated`)."""
        if self.refused or self.matcher.accept_token(token_id):
            return
        logger.error("structured output: the grammar refused sampled token %d", token_id)
        self.refused = True

    @property
    def is_terminated(self) -> bool:
        """True once the JSON is complete and the grammar accepted a stop token (EOS)."""
        return self.refused or self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` ([*, ceil(V / 32)] int32, bit
        t % 32 of word t // 32 set when token t is allowed)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.allowed_words is not None:
            bitmask[row] &= self.allowed_words


class StructuredOutputManager:
    """Compiles grammars for one engine (vLLM's `StructuredOutputManager`).

    Args:
        tokenizer: the engine's Hugging Face tokenizer (None: structured output is refused).
        vocab_size: the model's vocabulary (logits width, tokens); ids the tokenizer lacks
            (padding) are never allowed.
        eos_token_ids: the model's EOS ids: the grammar's stop tokens (empty: xgrammar reads
            them from the tokenizer).
        max_threads: compiler threads.
    """

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int], max_threads: int = 2
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.max_threads = max_threads
        self._compiler: Any = None
        self._allowed_words: torch.Tensor | None = None

    @property
    def compiler(self) -> Any:
        """The xgrammar `GrammarCompiler`, built (with the `TokenizerInfo`) on first use."""
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer,
                vocab_size=self.vocab_size,
                stop_token_ids=self.eos_token_ids or None,
            )
            self._compiler = xgr.GrammarCompiler(
                info, max_threads=self.max_threads, cache_limit_bytes=GRAMMAR_CACHE_BYTES
            )
            self._allowed_words = no_control_bytes_bitmask(info.decoded_vocab)
        return self._compiler

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of `params` (from the cache when its schema text was seen).

        Raises:
            RequestError: INVALID_ARGUMENT, field "response_format": no tokenizer, or a schema
                xgrammar cannot compile (its reason in the message).
        """
        if self.tokenizer is None:
            raise RequestError(
                ErrorCode.INVALID_ARGUMENT,
                "response_format",
                "response_format: structured output needs the model's tokenizer, and this "
                "checkpoint ships none",
            )
        schema = params.json if params.json is not None else JSON_OBJECT_SCHEMA
        try:
            return self.compiler.compile_json_schema(schema, **_JSON_LAYOUT)
        except (RuntimeError, ValueError, TypeError) as e:
            reason = _XGRAMMAR_PREFIX.sub("", str(e).strip().splitlines()[0])
            raise RequestError(
                ErrorCode.INVALID_ARGUMENT,
                "response_format",
                f"response_format: the JSON schema cannot be used: {reason}",
            ) from None

    def new_grammar(self, compiled: Any) -> RequestGrammar:
        """A fresh per-completion grammar state of a grammar `compile` returned."""
        import xgrammar as xgr

        return RequestGrammar(xgr.GrammarMatcher(compiled), self._allowed_words)


def no_control_bytes_bitmask(decoded_vocab: list[bytes]) -> torch.Tensor:
    """[ceil(V / 32)] int32 bitmask (xgrammar's layout) of the tokens whose bytes are all
    >= 0x20: the only ones compact JSON may contain (special tokens keep their bit: their
    decoded text, e.g. b"<|eos|>", has no control byte).

    Args:
        decoded_vocab: per token id, its bytes (`TokenizerInfo.decoded_vocab`, V entries).
    """
    vocab = len(decoded_vocab)
    words = (vocab + 31) // 32
    ok = torch.zeros(words * 32, dtype=torch.int64)
    ok[:vocab] = torch.tensor([min(t, default=0x20) >= 0x20 for t in decoded_vocab])
    weights = torch.ones(32, dtype=torch.int64) << torch.arange(32)
    packed = (ok.view(words, 32) * weights).sum(dim=1)  # each word's bits, as uint32 values
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


class GrammarBitmask:
    """The per-step token bitmask of the batch rows that have a grammar.

    Args:
        max_num_seqs: rows of the buffer (the most rows one step samples).
    """

    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self._bitmask: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """Mask, in place, the disallowed tokens of each grammar row of `logits` to -inf.

        Args:
            logits: [N, V] float32 on the engine's device, row i for `requests[i]`.

        Returns:
            the rows masked (those whose request has a grammar); empty: nothing was touched.
        """
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        if not rows:
            return rows
        import xgrammar as xgr

        n, vocab = logits.shape
        words = (vocab + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < n or self._bitmask.shape[1] != words:
            self._bitmask = xgr.allocate_token_bitmask(max(self.max_num_seqs, n), vocab)
        bitmask = self._bitmask[:n]
        for i in rows:
            requests[i].grammar.fill_bitmask(bitmask, i)
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)
        return rows
