"""Tiny chat checkpoints per tool-calling family: the tiny Qwen3-MoE weights with a small
byte-level BPE whose last ids are the family's marker strings (special tokens where the family's
tokenizer makes them special, plain added tokens where it does not), and the family's test chat
template (`tests/chat_templates/<family>.jinja`, written for these tests to each format's
documentation; nothing is downloaded).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from moe_engine.startup.demo import write_tokenizer

TEMPLATES = Path(__file__).parent / "chat_templates"
#: The tiny checkpoints' vocabulary (tests/fixtures.py `_COMMON`): markers take its last ids.
VOCAB_SIZE = 512

_DEEPSEEK_SPECIAL = [
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
]
_QWEN_ADDED = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>",
               "</tool_response>"]

#: family -> (special tokens, added non-special tokens), after each family's tokenizer.
MARKERS: dict[str, tuple[list[str], list[str]]] = {
    "qwen3": (["<|im_start|>", "<|im_end|>"], _QWEN_ADDED),
    "qwen3_coder": (["<|im_start|>", "<|im_end|>"], _QWEN_ADDED),
    "deepseek_v3": (_DEEPSEEK_SPECIAL, ["<think>", "</think>"]),
    "deepseek_v31": (_DEEPSEEK_SPECIAL, ["<think>", "</think>"]),
    "kimi_k2": (["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>",
                 "<|im_end|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                 "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"],
                ["<think>", "</think>"]),
    "glm45": (["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
               "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
               "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>"], []),
    "gpt_oss": (["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                 "<|return|>", "<|call|>"], []),
}


def union_markers() -> tuple[list[str], list[str]]:
    """Every family's markers: special where any family's tokenizer makes them special."""
    special = list(dict.fromkeys(t for sp, _ in MARKERS.values() for t in sp))
    added = list(dict.fromkeys(t for _, ad in MARKERS.values() for t in ad if t not in special))
    return special, added


def chat_template(family: str) -> str:
    """The family's test chat template (Jinja text)."""
    return (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")


def family_checkpoint(base_ckpt: Path, root: Path, family: str) -> Path:
    """`base_ckpt`'s weights with the family's tokenizer markers and chat template.

    Args:
        base_ckpt: a tiny checkpoint with a VOCAB_SIZE vocabulary (e.g. `qwen3_ckpt`).
        root: where the copy goes (`root / f"chat-{family}"`, reused when present).
        family: a key of MARKERS, or "all": every family's markers (`union_markers`) and
            Qwen3's template (a server switches templates per test with --chat-template's
            setting).
    """
    special, added = union_markers() if family == "all" else MARKERS[family]
    path = root / f"chat-{family}"
    if (path / "tokenizer.json").is_file():
        return path
    shutil.copytree(base_ckpt, path, dirs_exist_ok=True)
    write_tokenizer(path, vocab_size=VOCAB_SIZE - len(special) - len(added), max_chars=200_000)
    tok = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    next_id = max(t["id"] for t in tok["added_tokens"])
    next_id = max(next_id, max(tok["model"]["vocab"].values())) + 1
    for text, is_special in [(t, True) for t in special] + [(t, False) for t in added]:
        tok["added_tokens"].append({
            "id": next_id, "content": text, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": is_special})
        next_id += 1
    assert next_id <= VOCAB_SIZE, (family, next_id)
    (path / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = chat_template("qwen3" if family == "all" else family)
    config["additional_special_tokens"] = special
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                           encoding="utf-8")
    return path
