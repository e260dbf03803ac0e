"""The checkpoint's tokenizer, loaded once the same way by the front end and the engine core."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: Files whose presence in the model directory means it ships a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(model_dir: str) -> Any | None:
    """The checkpoint's tokenizer (`transformers.AutoTokenizer` for `model_dir`), or None when
    it ships none (no tokenizer files).

    `model_max_length` is set to transformers' VERY_LARGE_INTEGER: the engine enforces its own
    prompt limits (max_model_len, --max-prompt-tokens), and the tokenizer's own limit would
    only log "Token indices sequence length is longer than the specified maximum".
    """
    path = Path(model_dir)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

    return AutoTokenizer.from_pretrained(
        str(path), trust_remote_code=False, model_max_length=VERY_LARGE_INTEGER
    )
