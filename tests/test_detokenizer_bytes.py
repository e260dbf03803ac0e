"""The detokenizer, per-token texts and per-token bytes on a byte-level BPE whose tokens split
UTF-8 characters (`bpe_tokenizer`): a stop string completed by a token that also starts a
multi-byte character stops right there (mid-stream and as the last token), the final flush
checks stop strings too, include_stop_str_in_output and skip_special_tokens, and each token's
bytes from the vocabulary rebuild the text."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from bpe_tokenizer import token_bytes_table, write_bpe_tokenizer

from moe_engine.core.detokenizer import IncrementalDetokenizer, TokenTexts
from moe_engine.core.token_bytes import TokenBytes, unicode_to_bytes


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    path: Path = tmp_path_factory.mktemp("bpe")
    write_bpe_tokenizer(path, 512)
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def table(tok) -> dict[int, bytes]:
    return token_bytes_table(tok)


def _id(table: dict[int, bytes], b: bytes) -> int:
    return next(i for i, v in table.items() if v == b)


def _split_token(table: dict[int, bytes]) -> tuple[int, bytes, bytes]:
    """A token of ASCII bytes followed by the first byte(s) of a multi-byte character, and a
    token that completes that character: (id, ascii part, the completing bytes)."""
    for i, b in sorted(table.items()):
        k = len(b) - len(b.rstrip(bytes(range(0xC2, 0xF5))))  # trailing lead bytes
        if k == 1 and len(b) > 1 and b[:-1].isascii() and b[:-1].strip():
            need = 2 if b[-1] < 0xE0 else 3 if b[-1] < 0xF0 else 4
            for c in sorted(table.values()):
                if len(c) == need - 1 and not _invalid(b[-1:] + c):
                    return i, b[:-1], c
    raise AssertionError("the BPE has no ASCII + lead-byte token")


def _run(detok: IncrementalDetokenizer, ids: list[int], last_is_final: bool = True):
    """Feed `ids`; (index of the token that matched a stop string or None, streamed text)."""
    deltas, hit = [], None
    for n, t in enumerate(ids):
        if detok.add(t):
            hit = n
            break
        deltas.append(detok.take_delta(final=False))
    deltas.append(detok.take_delta(final=last_is_final))
    return hit, "".join(deltas)


def test_the_bpe_splits_characters(tok, table) -> None:
    partial = [b for b in table.values() if _invalid(b)]
    both = [b for b in partial if not _invalid(b[:1]) or b[:1].isascii()]
    assert len(partial) > 100 and len(both) > 5  # parts of characters; ends that start one
    assert tok.decode(tok.encode("café日本語😀")) == "café日本語😀"


def _invalid(b: bytes) -> bool:
    try:
        b.decode()
    except UnicodeDecodeError:
        return True
    return False


@pytest.mark.parametrize("as_last_token", [True, False])
def test_stop_completed_by_a_token_that_starts_a_character(tok, table, as_last_token) -> None:
    split, ascii_part, rest = _split_token(table)
    head = [_id(table, b"x")]
    ids = [*head, split] + ([] if as_last_token else [_id(table, rest), _id(table, b"y")])
    stop = "x" + ascii_part.decode()
    detok = IncrementalDetokenizer(tok, [stop])
    hit, text = _run(detok, ids)
    assert hit == 1, "the stop string ends at the token that completes it"
    assert (detok.stopped, detok.stop_string, text) == (True, stop, "")
    detok = IncrementalDetokenizer(tok, [stop], include_stop_str_in_output=True)
    assert _run(detok, ids) == (1, stop)


def test_final_flush_checks_stop_strings(tok, table) -> None:
    split, ascii_part, _ = _split_token(table)
    ids = [_id(table, b"x"), split]
    full = tok.decode(ids)
    assert full == "x" + ascii_part.decode() + "\ufffd"
    stop = ascii_part.decode()[-1:] + "\ufffd"  # only the final flush writes the U+FFFD
    detok = IncrementalDetokenizer(tok, [stop])
    hit, text = _run(detok, ids)
    assert hit is None and (detok.stopped, detok.stop_string) == (True, stop)
    assert text == full[: full.index(stop)]
    detok = IncrementalDetokenizer(tok, ["\ufffd"])  # min_tokens not reached: no stop
    for t in ids:
        assert not detok.add(t, check_stop=False)
    assert detok.take_delta(final=True) == full and not detok.stopped


def test_streamed_text_is_the_decode_and_pieces_rebuild_it(tok, table) -> None:
    rng = random.Random(0)
    words = ["日本語", "café", " naïve", "😀🎉", "漢字です", " Привет", "x", " stop"]
    for _ in range(20):
        text = "".join(rng.choice(words) for _ in range(rng.randint(1, 8)))
        ids = tok.encode(text)
        for special in (True, False):
            if not special:
                ids = [*ids[:2], 2, *ids[2:]]  # an <|eos|> inside
            want = tok.decode(ids, skip_special_tokens=special)
            detok = IncrementalDetokenizer(tok, [], skip_special_tokens=special)
            assert _run(detok, ids) == (None, want)
            texts = TokenTexts(tok, special)
            pieces = texts.add(ids)
            pieces[-1] += texts.finish()
            assert "".join(pieces) == want
            assert b"".join(table[i] for i in ids if special or i != 2) == text.encode()


def test_token_bytes_are_the_vocabulary_bytes(tok, table) -> None:
    own = TokenBytes(tok)
    assert own.byte_level
    assert {i: own(i) for i in table} == table
    assert own(2) == b"<|eos|>" and tok.decode([_split_token(table)[0]]).endswith("\ufffd")
    assert len(unicode_to_bytes()) == 256


def test_token_bytes_of_a_sentencepiece_style_vocabulary(tmp_path) -> None:
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<0xE6>": 1, "<0x97>": 2, "<0xA5>": 3, "\u2581hi": 4, "x": 5}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
    ])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    own = TokenBytes(tok)
    assert not own.byte_level and own.sentencepiece
    assert [own(i) for i in (1, 2, 3, 4, 5)] == [b"\xe6", b"\x97", b"\xa5", b" hi", b"x"]
    assert tok.decode([4, 1, 2, 3]) == " hi日"


def _reference(tok, ids: list[int], stops: list[str]) -> tuple[int | None, str, str | None]:
    """What the detokenizer must return, from whole decodes: the first token k whose whole
    characters so far (decode(ids[:k+1]) without a trailing U+FFFD) hold a stop string, the
    text before its earliest match; else the final text (held bytes as U+FFFD) checked once
    more."""
    def first(text: str):
        hits = [(i, s) for s in stops if (i := text.find(s)) != -1]
        return min(hits, key=lambda h: h[0]) if hits else None

    for k in range(len(ids)):
        text = tok.decode(ids[: k + 1], skip_special_tokens=True).rstrip("\ufffd")
        if (hit := first(text)) is not None:
            return k, text[: hit[0]], hit[1]
    text = tok.decode(ids, skip_special_tokens=True)
    hit = first(text)
    return (None, text, None) if hit is None else (None, text[: hit[0]], hit[1])


def test_random_streams_match_whole_decodes(tok) -> None:
    rng = random.Random(1)
    for _ in range(300):
        ids = rng.choices(range(16, 512), k=rng.randint(1, 16))
        text = tok.decode(ids)
        stops = []
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(len(text))
            stops.append(text[a : a + rng.randint(1, 4)])
        if rng.random() < 0.2:
            stops.append("zz-not-there")
        detok = IncrementalDetokenizer(tok, stops)
        hit, streamed = _run(detok, ids)
        assert (hit, streamed, detok.stop_string) == _reference(tok, ids, stops), (ids, stops)
