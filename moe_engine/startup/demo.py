"""The built-in demo checkpoint: a small Qwen3-MoE with random weights and a real tokenizer.

`moe-serve` without `--model` serves it. Nothing is downloaded: the weights are drawn from a
seeded RNG with `transformers.AutoModelForCausalLM.from_config`, and the tokenizer is a
byte-level BPE (4,096 tokens) trained with the `tokenizers` library on the Python standard
library's own source files (sorted, capped at 8 MB, about two seconds on two cores). The
checkpoint is written once into a cache directory, atomically (a temporary directory renamed
into place), and reused after.

The weights are identical wherever they are made; the tokenizer depends on the standard-library
text of the interpreter that makes it (so on the Python version).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kernels.env import cache_root

logger = logging.getLogger(__name__)

#: Name of the checkpoint directory under the cache root; bump when anything below changes.
DEMO_NAME = "demo-v2"
#: Token ids of the special tokens, shared by the tokenizer and config.json.
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>"]
#: A ChatML-like chat template (tokenizer_config.json "chat_template") over the demo's own
#: special tokens: `<|bos|>` opens a turn (ChatML's <|im_start|>), `<|eos|>` closes it
#: (<|im_end|>; it is also the model's EOS, so a reply ends with its turn). Since demo-v2.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|bos|>{{ message['role'] }}\n{{ message['content'] }}<|eos|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)
VOCAB_SIZE = 4096
#: Most characters of standard-library source the tokenizer is trained on.
CORPUS_CHARS = 8_000_000
SEED = 0

#: The demo model: 6 MoE layers, 16 experts of width 256, top-4; 22.0 M parameters (44 MB in
#: bfloat16). A large initializer_range keeps greedy continuations from collapsing into one
#: repeated token.
DEMO_CONFIG = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 768,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "initializer_range": 0.1,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
}


def default_cache_dir() -> Path:
    """The cache root: $MOE_ENGINE_CACHE, else ~/.cache/moe-engine (`kernels.env.cache_root`)."""
    return cache_root()


def ensure_demo_checkpoint(cache_dir: str | None = None) -> str:
    """The demo checkpoint's directory, created on first use.

    Args:
        cache_dir: cache root (default `default_cache_dir()`); the checkpoint is
            `cache_dir/demo-v2` (config.json, model.safetensors, generation_config.json,
            tokenizer.json, tokenizer_config.json).

    Returns:
        The checkpoint directory as a string.

    Raises:
        OSError: when the cache directory cannot be written.
    """
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    final = root / DEMO_NAME
    if (final / "config.json").is_file():
        logger.info("demo checkpoint: using %s", final)
        return str(final)
    root.mkdir(parents=True, exist_ok=True)
    logger.info("demo checkpoint: creating %s (random weights, BPE tokenizer)", final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}.tmp-", dir=root))
    try:
        write_tokenizer(tmp)
        write_model(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not another process winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("demo checkpoint: wrote %s", final)
    return str(final)


def write_model(path: Path) -> None:
    """Draw the demo weights (seeded) and save them as bfloat16 safetensors into `path`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_moe", **DEMO_CONFIG)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)


def write_tokenizer(
    path: Path, vocab_size: int = VOCAB_SIZE, max_chars: int = CORPUS_CHARS
) -> None:
    """Train the byte-level BPE and save tokenizer.json + tokenizer_config.json into `path`.

    `vocab_size` (tokens) and `max_chars` (characters of training text) default to the demo's;
    tests make smaller tokenizers for the tiny checkpoints with them.

    The files load with `transformers.AutoTokenizer.from_pretrained(path)`; no BOS is added to
    encoded text; eos is `<|eos|>` (id 2), bos `<|bos|>` (1), pad `<|pad|>` (0); the chat
    template is `CHAT_TEMPLATE`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(max_chars), trainer=trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[PAD_ID],
        "model_max_length": DEMO_CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def corpus(max_chars: int = CORPUS_CHARS) -> Iterator[str]:
    """Text to train on: the standard library's .py files (tests, idlelib and site-packages
    left out), in sorted path order, up to `max_chars` characters; a few lines of built-in
    docstrings when no source is installed."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib"}
    files = sorted(p for p in stdlib.rglob("*.py") if not skip & set(p.relative_to(stdlib).parts))
    total = 0
    for file in files:
        text = file.read_text(encoding="utf-8", errors="replace")
        if total + len(text) > max_chars:
            break
        total += len(text)
        yield text
    if total == 0:
        import builtins

        yield "\n".join(getattr(builtins, n).__doc__ or "" for n in sorted(dir(builtins)))
