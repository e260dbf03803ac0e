"""A small byte-level BPE whose vocabulary splits UTF-8 characters, for the byte-exact text
tests (issue 44): trained at test time with the `tokenizers` library (ByteLevel pre-tokenizer,
BPE trainer) over text heavy in multi-byte characters (CJK, emoji, accented Latin), so that it
has tokens that hold part of a character and tokens that complete one character and start the
next multi-byte one, as real vocabularies (GPT-2's, Qwen's, DeepSeek's) do.

`write_bpe_tokenizer(path, vocab_size)` writes tokenizer.json + tokenizer_config.json that
`transformers.AutoTokenizer` loads; `bpe_checkpoint` copies a tiny checkpoint beside it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

#: Special tokens at ids 0, 1, 2 (pad, bos, eos) as the tiny checkpoints' config.json says, then
#: more (ids 3..15) so that a random model's greedy output holds some (skip_special_tokens).
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", *(f"<|extra_{i}|>" for i in range(13))]
#: Short multi-byte words; repeated in different orders so that merges cross character
#: boundaries (a pre-token is a run of letters, so "日本語" is one word of 9 bytes).
_WORDS = [
    "日本語", "中文字", "東京都", "漢字です", "こんにちは", "ありがとう", "한국어", "서울시",
    "café", "naïve", "señor", "über", "façade", "résumé", "Ærø", "smörgåsbord", "jalapeño",
    "Ελληνικά", "русский", "Привет", "€", "£", "→", "✓", "😀", "🎉", "🚀", "👍🏽", "❤️",
]
#: ASCII words, so that ASCII + multi-byte merges ("caf" + first byte of "é") exist too.
_ASCII = ["cafe", "stop", "end", "the", "data", "token", "x", "ab"]


def corpus(repeats: int = 40) -> list[str]:
    """The training text: every ordered pair of words, joined without and with a space."""
    words = _WORDS + _ASCII
    lines = []
    for _ in range(repeats):
        for i, a in enumerate(words):
            b = words[(i * 7 + 3) % len(words)]
            lines.append(f"{a}{b} {a} {b}{a}")
    return lines


def write_bpe_tokenizer(path: Path, vocab_size: int) -> None:
    """Train the BPE (`vocab_size` tokens, specials included) and save it into `path`.

    The files load with `transformers.AutoTokenizer.from_pretrained(path)`: no BOS is added to
    encoded text, eos is `<|eos|>` (id 2); a ChatML-like chat template over the specials.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"trained {tokenizer.get_vocab_size()} tokens, wanted {vocab_size}")
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[1], "eos_token": SPECIAL_TOKENS[2],
        "pad_token": SPECIAL_TOKENS[0], "clean_up_tokenization_spaces": False,
        "chat_template": (
            "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
        ),
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def bpe_checkpoint(ckpt: Path, root: Path) -> Path:
    """A copy of the tiny checkpoint `ckpt` with this BPE (its vocab_size from config.json)."""
    path = root / f"{ckpt.name}-bpe-multibyte"
    if not (path / "tokenizer.json").is_file():
        shutil.copytree(ckpt, path, dirs_exist_ok=True)
        vocab_size = json.loads((ckpt / "config.json").read_text())["vocab_size"]
        write_bpe_tokenizer(path, vocab_size)
    return path


def token_bytes_table(tokenizer) -> dict[int, bytes]:
    """Every id's bytes, straight from tokenizer.json's vocabulary and GPT-2's byte table
    (a reference written apart from `moe_engine.core.token_bytes`)."""
    from tokenizers import pre_tokenizers

    byte_of = {c: _gpt2_order(c) for c in pre_tokenizers.ByteLevel.alphabet()}
    table = {}
    for token, i in tokenizer.get_vocab().items():
        if token in SPECIAL_TOKENS:
            table[i] = token.encode()
        else:
            table[i] = bytes(byte_of[c] for c in token)
    return table


def _gpt2_order(c: str) -> int:
    """The byte a GPT-2 alphabet character stands for: printable bytes are themselves, the
    others were moved to 256 + k in byte order."""
    o = ord(c)
    if o < 256:
        return o
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    missing = [b for b in range(256) if b not in kept]
    return missing[o - 256]
