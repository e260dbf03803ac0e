"""The transformers oracle of routing replay: the router top-k ids of every MoE layer.

`hf_routed_experts(ckpt, ids)` runs the checkpoint's transformers model once over `ids` (the
prompt then the outputs but the last: the tokens the engine ran) with a forward hook on every
MoE block's router (`*.mlp.gate`, or gpt-oss's `*.mlp.router`, which return (router_logits,
topk_weights, topk_ids) in transformers 5 for Qwen3-MoE, DeepSeek-V3, GLM-4.5, gpt-oss), so
the ids are the family's own routing (softmax / sigmoid, correction bias, groups). Ids are
compared sorted per token: the order of ties may differ between the two top-k implementations.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch


@functools.lru_cache(maxsize=4)
def _hf_model(ckpt: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def hf_routed_experts(ckpt: Path, ids: list[int]) -> np.ndarray:
    """[len(ids), moe_layers, top_k] int32: transformers' router top-k ids over `ids`, one
    forward, MoE layers in layer order."""
    model = _hf_model(str(ckpt))
    got: list[torch.Tensor] = []
    gates = [m for name, m in model.named_modules() if name.endswith(("mlp.gate", "mlp.router"))]
    assert gates, "no `mlp.gate` / `mlp.router` modules found in the transformers model"
    hooks = [g.register_forward_hook(lambda mod, args, out: got.append(out[2].clone()))
             for g in gates]
    try:
        with torch.inference_mode():
            model(torch.tensor([ids], dtype=torch.long))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(got, dim=1).to(torch.int32).numpy()


def assert_routing_equal(got: np.ndarray, ckpt: Path, prompt: list[int],
                         output: list[int]) -> None:
    """`got` (the engine's routed experts of one completion) has shape
    [len(prompt) + len(output) - 1, L, k] and equals transformers' ids per token and layer
    (sorted per token)."""
    ids = list(prompt) + list(output[:-1])
    ref = hf_routed_experts(ckpt, ids)
    assert got is not None, "no routed experts returned"
    assert got.dtype == np.int32
    assert got.shape == ref.shape == (len(prompt) + len(output) - 1, *ref.shape[1:]), (
        got.shape, ref.shape)
    bad = np.nonzero((np.sort(got, -1) != np.sort(ref, -1)).any(-1))
    assert bad[0].size == 0, (
        f"routing differs at (token, layer) {list(zip(*bad, strict=True))[:8]}: "
        f"engine {got[bad][:4].tolist()} transformers {ref[bad][:4].tolist()}"
    )
