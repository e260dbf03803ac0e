"""Bytes of weights one batch-1 decode step reads, from a checkpoint's or a GGUF's tensor sizes,
and the DRAM read rate a streaming-read microbenchmark reaches (`bench/real_scale.py`).

A decode step of one token reads every weight once except the experts and the embedding: of
each MoE layer's experts only the `top_k` of `E` it is routed to (so top_k / E of their bytes,
biases and scales included), of the embedding one row. The parts (bytes per token):

  experts    routed experts' matrices, biases, MXFP4 blocks and scales (top_k / E of them);
  attention  q/k/v/o projections, their biases, sinks, q/k norms;
  lm_head    the output matrix (the whole vocabulary, every token);
  router     the router / gate matrices (and biases);
  embedding  one row of the input embedding;
  other      the rest (norms).

Checkpoint names are Hugging Face's (`model.layers.N.mlp.experts...`); GGUF names llama.cpp's
(`blk.N.ffn_{gate,up,down}_exps`, `blk.N.attn_*`, `output.weight`, `token_embd.weight`).
"""

from __future__ import annotations

import json
import statistics
import struct
import time
from pathlib import Path

import torch

PARTS = ("experts", "attention", "lm_head", "router", "embedding", "other")


def safetensors_sizes(ckpt: Path) -> dict[str, int]:
    """Tensor name -> bytes, from the headers of every *.safetensors file of `ckpt`."""
    sizes = {}
    for path in sorted(ckpt.glob("*.safetensors")):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                begin, end = info["data_offsets"]
                sizes[name] = end - begin
    return sizes


def hf_part(name: str) -> str:
    """The part (PARTS) a Hugging Face checkpoint tensor belongs to."""
    if ".mlp.experts." in name:
        return "experts"
    if ".self_attn." in name:
        return "attention"
    if name.startswith("lm_head."):
        return "lm_head"
    if ".mlp.router." in name or ".mlp.gate.weight" in name:
        return "router"
    if "embed_tokens" in name:
        return "embedding"
    return "other"


def gguf_part(name: str) -> str:
    """The part (PARTS) a llama.cpp GGUF tensor belongs to."""
    if "_exps." in name:
        return "experts"
    if ".attn_" in name:
        return "attention"
    if name.startswith("output."):
        return "lm_head"
    if ".ffn_gate_inp." in name:
        return "router"
    if name.startswith("token_embd."):
        return "embedding"
    return "other"


def bytes_per_token(sizes: dict[str, int], part_of, top_k: int, num_experts: int,
                    vocab_size: int) -> dict[str, int]:
    """Bytes per part (PARTS) one batch-1 decode token reads, and their `total`.

    sizes: tensor name -> bytes; part_of: name -> part (`hf_part` / `gguf_part`).
    """
    parts = dict.fromkeys(PARTS, 0.0)
    for name, n in sizes.items():
        part = part_of(name)
        share = {"experts": top_k / num_experts, "embedding": 1 / vocab_size}.get(part, 1.0)
        parts[part] += n * share
    out = {k: round(v) for k, v in parts.items()}
    out["total"] = sum(out.values())
    return out


def checkpoint_bytes_per_token(ckpt: Path) -> dict[str, int]:
    """`bytes_per_token` of a Hugging Face checkpoint folder (top_k / E from its config)."""
    config = json.loads((ckpt / "config.json").read_text())
    return bytes_per_token(safetensors_sizes(ckpt), hf_part, config["num_experts_per_tok"],
                           config.get("num_local_experts") or config["num_experts"],
                           config["vocab_size"])


def served_bytes_per_token(ckpt_bytes: dict[str, int], ckpt_expert_bits: float,
                           expert_bits: float | None, dense_bits: float | None) -> dict[str, int]:
    """The checkpoint's `bytes_per_token` as an engine that re-stores weights reads them: the
    experts at `expert_bits` per weight (None: as stored, `ckpt_expert_bits` each), attention
    and LM head at `dense_bits` (None: as stored, bfloat16)."""
    out = dict(ckpt_bytes)
    if expert_bits is not None:
        out["experts"] = round(out["experts"] * expert_bits / ckpt_expert_bits)
    if dense_bits is not None:
        for part in ("attention", "lm_head"):
            out[part] = round(out[part] * dense_bits / 16)
    out["total"] = sum(out[p] for p in PARTS)
    return out


def gguf_bytes_per_token(path: Path, gguf_py: Path) -> dict[str, int]:
    """`bytes_per_token` of a GGUF file, read with llama.cpp's own gguf-py (`gguf_py` folder)."""
    import sys

    if str(gguf_py) not in sys.path:
        sys.path.insert(0, str(gguf_py))
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    top_k = int(reader.fields[f"{arch}.expert_used_count"].contents())
    experts = int(reader.fields[f"{arch}.expert_count"].contents())
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    vocab = next(int(t.shape[-1]) for t in reader.tensors if t.name == "token_embd.weight")
    return bytes_per_token(sizes, gguf_part, top_k, experts, vocab)


def stream_read_gbps(gib: float = 4.0, threads: int = 2, repeats: int = 7) -> dict:
    """DRAM read rate of `torch.sum` over a `gib` GiB float32 tensor with `threads` threads:
    {"median_gbps", "best_gbps", "runs_gbps"} (GB = 1e9 bytes), after one untimed pass."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
        x.sum()
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            x.sum()
            runs.append(x.numel() * 4 / (time.perf_counter() - t0) / 1e9)
        del x
    finally:
        torch.set_num_threads(old)
    return {"median_gbps": round(statistics.median(runs), 2), "best_gbps": round(max(runs), 2),
            "runs_gbps": [round(r, 2) for r in runs], "gib": gib, "threads": threads}
