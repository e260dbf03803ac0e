"""Incremental detokenization with stop strings that are never streamed.

Text is decoded in a sliding window of token ids (the prefix/read offsets of Hugging Face's
TextStreamer and vLLM's `detokenize_incrementally`), so each step costs O(window), not O(text).
A delta that ends in U+FFFD (an incomplete UTF-8 sequence) waits for the next token. Text that
could still become the start of a stop string is held back until it cannot.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text deltas.

    Args:
        tokenizer: a transformers tokenizer.
        stop: stop strings; the first match ends the request and is cut from the text.
        skip_special_tokens: leave special tokens out of the text (False: keep them).
    """

    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted = 0
        self.stopped = False
        #: The stop string that matched (set with `stopped`).
        self.stop_string: str | None = None

    def add(self, token_id: int, check_stop: bool = True) -> bool:
        """Append a generated token; True when a stop string just matched (if `check_stop`)."""
        self.token_ids.append(token_id)
        decode, skip = self.tokenizer.decode, self.skip_special_tokens
        prefix = decode(
            self.token_ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip
        )
        full = decode(self.token_ids[self._prefix_offset :], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        old_len = len(self.text)
        self.text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return check_stop and self._check_stop(old_len)

    def _check_stop(self, old_len: int) -> bool:
        if not self.stop:
            return False
        search_from = max(0, old_len - self._holdback)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) != -1]
        if not hits:
            return False
        start, self.stop_string = min(hits, key=lambda hit: hit[0])  # the earliest match wins
        self.text = self.text[:start]
        self.stopped = True
        return True

    def take_delta(self, final: bool) -> str:
        """Text not yet returned; unless `final`, minus a tail that may start a stop string.

        On the final call, tokens still held back as an incomplete UTF-8 sequence are decoded
        as they are (with U+FFFD), so the streamed text equals `tokenizer.decode(token_ids)`.
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
        ids = self.token_ids
        if self._read_offset == len(ids):
            return
        decode, skip = self.tokenizer.decode, self.skip_special_tokens
        prefix = decode(ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        full = decode(ids[self._prefix_offset :], skip_special_tokens=skip)
        if len(full) > len(prefix):
            self.text += full[len(prefix) :]
        self._prefix_offset = self._read_offset = len(ids)

    def _unsafe_tail(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        text = self.text
        for n in range(min(self._holdback, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
