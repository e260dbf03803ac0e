"""Each token's own bytes, read from the vocabulary (not from decoding the token alone, which
writes U+FFFD for a token that holds part of a UTF-8 character).

Three vocabulary encodings are read:
- byte-level BPE (GPT-2, Llama 3, Qwen, DeepSeek; a `ByteLevel` decoder): each character of the
  token string stands for one byte through GPT-2's `bytes_to_unicode` table (openai/gpt-2
  `src/encoder.py`: the printable bytes map to themselves, the others to U+0100 onward);
- SentencePiece-style vocabularies (Llama 2, Mistral, Gemma): byte-fallback tokens `<0xAB>` are
  the byte 0xAB, and the metaspace `▁` (U+2581) is a space;
- anything else: the UTF-8 of the token decoded alone.
Added tokens (special or not) are their content's UTF-8 in every case.

So the `bytes` of a sequence of generated tokens concatenate to the UTF-8 of its decoded text
(OpenAI's chat logprobs contract for `bytes`), except where the decoder itself changes the
text (special tokens skipped, a SentencePiece decoder's stripped leading space).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

#: A SentencePiece byte-fallback token, e.g. "<0xE2>".
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
METASPACE = "\u2581"


@functools.cache
def unicode_to_bytes() -> dict[str, int]:
    """The inverse of GPT-2's `bytes_to_unicode`: character -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _decoder_types(tokenizer: Any) -> set[str]:
    """The `type`s of the fast tokenizer's decoder and its parts (empty for a slow one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return set()
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                found.add(node["type"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(decoder.__getstate__()))
    return found


class TokenBytes:
    """token id -> the token's bytes (cached per id).

    Args:
        tokenizer: a transformers tokenizer (fast or slow).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        types = _decoder_types(tokenizer)
        self.byte_level = "ByteLevel" in types
        #: A SentencePiece-style vocabulary: a fast one's decoder says so; a slow tokenizer
        #: (no decoder to read) is one (transformers' slow ones are SentencePiece models).
        self.sentencepiece = bool(types & {"ByteFallback", "Metaspace", "Replace"}) or not types
        self._added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._lookup(token_id)
        return cached

    def _lookup(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:  # an id outside the vocabulary
            return b""
        if self.byte_level:
            table = unicode_to_bytes()
            return b"".join(bytes([table[c]]) if c in table else c.encode() for c in piece)
        if not self.sentencepiece:
            return self.tokenizer.decode([token_id]).encode()
        match = _BYTE_TOKEN.fullmatch(piece)
        if match is not None:
            return bytes([int(match.group(1), 16)])
        return piece.replace(METASPACE, " ").encode()
