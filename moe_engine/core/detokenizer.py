"""Incremental detokenization with stop strings that are never streamed.

Text is decoded in a sliding window of token ids (the prefix/read offsets of Hugging Face's
TextStreamer and vLLM's `detokenize_incrementally`), so each step costs O(window), not O(text).
A window whose text ends in U+FFFD (an incomplete UTF-8 sequence: a token that holds part of a
character) waits for the next token; the complete characters before that sequence are checked
for stop strings at once, so a token that completes a stop string and starts a multi-byte
character ends the request there. Text that could still become the start of a stop string is
held back until it cannot. Every flush checks stop strings, the final one included.
"""

from __future__ import annotations

from typing import Any

#: What a decoder writes for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text deltas.

    Args:
        tokenizer: a transformers tokenizer.
        stop: stop strings; the earliest match ends the request and is cut from the text.
        include_stop_str_in_output: keep the matched stop string (the text after it is still
            cut), and stream text without holding back possible stop-string prefixes (vLLM).
        skip_special_tokens: leave the tokenizer's special tokens out of the text (vLLM's
            default True).
    """

    def __init__(
        self, tokenizer: Any, stop: list[str], *, include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop_str_in_output = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self._longest = max((len(s) for s in stop), default=1)
        self._holdback = 0 if include_stop_str_in_output else self._longest - 1
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted = 0
        self._check_stop = True
        self.stopped = False
        #: The stop string that matched (set with `stopped`).
        self.stop_string: str | None = None

    @classmethod
    def from_params(cls, tokenizer: Any, params: Any) -> IncrementalDetokenizer:
        """The detokenizer a request's `SamplingParams` asks for."""
        return cls(
            tokenizer, list(params.stop),
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
        )

    def add(self, token_id: int, check_stop: bool = True) -> bool:
        """Append a generated token; True when a stop string just matched (if `check_stop`:
        False while min_tokens is not reached, and for the final flush after it)."""
        self.token_ids.append(token_id)
        self._check_stop = check_stop
        prefix, full = self._decode_window()
        if full.endswith(REPLACEMENT):
            # The window ends inside a character: its tokens wait for the rest, but the whole
            # characters before it may already complete a stop string.
            complete = full[len(prefix):].rstrip(REPLACEMENT)
            return check_stop and bool(complete) and self._match_stop(complete)
        if len(full) <= len(prefix):
            return False
        new = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        if check_stop and self._match_stop(new):
            return True
        self.text += new
        return False

    def _decode_window(self) -> tuple[str, str]:
        """(text of the window's tokens already read, text of the whole window)."""
        ids, skip = self.token_ids, self.skip_special_tokens
        decode = self.tokenizer.decode
        prefix = decode(ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        return prefix, decode(ids[self._prefix_offset :], skip_special_tokens=skip)

    def _match_stop(self, new: str) -> bool:
        """Look for the earliest stop string that ends inside `new`, the text that follows
        `self.text` (the text before was checked already, or was not to be checked). On a
        match the text becomes everything before it (through it with
        include_stop_str_in_output), `stopped` is set and True returned; else nothing
        changes. Costs O(len(new) + longest stop string), not O(text)."""
        if not self.stop:
            return False
        base = max(0, len(self.text) - self._longest + 1)
        window = self.text[base:] + new
        old_len = len(self.text) - base
        hits = []
        for s in self.stop:
            i = window.find(s, max(0, old_len - len(s) + 1))
            if i != -1:
                hits.append((i, s))
        if not hits:
            return False
        start, self.stop_string = min(hits, key=lambda hit: hit[0])  # the earliest match wins
        end = start + len(self.stop_string) * self.include_stop_str_in_output
        self.text = self.text[:base] + window[:end]
        self.stopped = True
        return True

    def take_delta(self, final: bool) -> str:
        """Text not yet returned; unless `final`, minus a tail that may start a stop string.

        On the final call, tokens still held back as an incomplete UTF-8 sequence are decoded
        as they are (with U+FFFD), so the streamed text equals `tokenizer.decode(token_ids)`
        (up to a stop string); that text is checked for stop strings too (`stopped` tells the
        caller when it matched only here).
        """
        if final and not self.stopped:
            self._flush_pending()
        end = len(self.text)
        if not final and self.stop:
            end -= self._unsafe_tail()
        end = max(end, self._emitted)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def _flush_pending(self) -> None:
        if self._read_offset == len(self.token_ids):
            return
        prefix, full = self._decode_window()
        self._prefix_offset = self._read_offset = len(self.token_ids)
        if len(full) > len(prefix):
            new = full[len(prefix):]
            if not (self._check_stop and self._match_stop(new)):
                self.text += new

    def _unsafe_tail(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        text = self.text
        for n in range(min(self._holdback, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0


class TokenTexts:
    """Each generated token's share of the decoded text, in order: the pieces concatenate to
    the text `IncrementalDetokenizer` makes of the same ids (before a stop string cuts it).

    A token that ends inside a character gets "" and the token that completes the character
    gets all of it; `finish` gives the last token what is still held (decoded with U+FFFD).
    Used for the legacy completions' `logprobs.tokens` and `text_offset`.

    Args:
        tokenizer: a transformers tokenizer.
        skip_special_tokens: as the request's `SamplingParams.skip_special_tokens`.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, [],
                                             skip_special_tokens=skip_special_tokens)

    def add(self, token_ids: list[int]) -> list[str]:
        """The pieces of `token_ids`, the next generated tokens."""
        pieces = []
        for token_id in token_ids:
            before = len(self._detok.text)
            self._detok.add(token_id, check_stop=False)
            pieces.append(self._detok.text[before:])
        return pieces

    def finish(self) -> str:
        """The text still held back at the end (belongs to the last token)."""
        before = len(self._detok.text)
        self._detok.take_delta(final=True)
        return self._detok.text[before:]
