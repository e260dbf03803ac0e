"""A Qwen3-MoE checkpoint whose router is skewed: a few hot experts take most tokens.

Runtime EPLB (issue 45) needs traffic where the contiguous placement overloads one rank. Random
weights route almost uniformly, so `make_skewed_checkpoint` builds the real architecture
(`transformers.AutoModelForCausalLM.from_config`, `Qwen3MoeForCausalLM`, every layer MoE) and
then edits two kinds of weights before saving (config.json + safetensors):

1. the token embedding gets a common component `offset * row_norm * u` (u a fixed unit vector,
   row_norm = initializer_range * sqrt(hidden_size), the typical length of a row), so the
   router inputs (post-attention RMSNorm of the residual stream) share a mean direction;
2. layer by layer, the router inputs of calibration prompts are captured (a forward hook on
   `mlp.gate`), their mean `mu` taken, and the hot experts' router rows get
   `strength * logit_scale * mu / |mu|^2` added (logit_scale = initializer_range *
   sqrt(hidden_size), the spread of a random router logit). A token's hot logits then rise by
   about `strength` standard deviations times its projection on `mu` (mean 1), so the hot
   experts win for most tokens but not all, and the other experts still see traffic.

The result is an ordinary checkpoint: transformers, the engine and the 4-bit quantizers load it
as any other, and greedy continuations still depend on the prompt. With the defaults (8 experts,
top-2, hot experts 0 and 1) the hot pair takes about 70-80% of the (token, expert) pairs; with
the contiguous placement both sit on rank 0, which therefore gets ~80% of the load at ep 2 and
~75% at ep 4 (`routing_shares` measures it; tests/test_skewed_checkpoint.py asserts it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from fixtures import tiny_config

#: Tiny defaults: 3 layers, all MoE (so every layer is skewed), 8 experts of width 32, top-2;
#: hidden 64 and moe_intermediate 32 are multiples of 32, so int4 (group 32) and MXFP4
#: (blocks of 32) quantize the experts.
SKEWED_TINY: dict[str, Any] = {
    "num_hidden_layers": 3,
    "mlp_only_layers": [],
    "num_experts": 8,
    "num_experts_per_tok": 2,
}
#: Hot experts by default: 0 and 1, both on rank 0 under the contiguous placement at ep 2 and 4.
DEFAULT_HOT = (0, 1)
#: Calibration prompts (token ids drawn from torch.Generator seed 123): 16 prompts of 48 tokens.
_CALIB = (16, 48)


def make_skewed_checkpoint(
    root: Path,
    *,
    hot_experts: Sequence[int] = DEFAULT_HOT,
    offset: float = 0.3,
    strength: float = 3.0,
    seed: int = 0,
    name: str | None = None,
    config: Any = None,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> Path:
    """Create (or reuse) a skewed Qwen3-MoE checkpoint directory under `root`.

    Args:
        root: parent directory; the checkpoint goes to `root / name` and is reused when its
            config.json exists.
        hot_experts: expert ids made hot in every MoE layer.
        offset: the embedding's common component, in units of a typical embedding row's norm.
        strength: the hot router rows' shift, in units of a random router logit's spread
            (larger: hotter; 3.0 gives ~70-80% of pairs to two of eight experts at top-2).
        seed: `torch.manual_seed` before the weights are drawn (the calibration prompts and
            u have their own fixed seeds).
        name: directory name; default derived from the arguments.
        config: a full `transformers` Qwen3-MoE config to use instead of the tiny one (the
            bench passes its own); `overrides` then must be empty.
        dtype: dtype of the saved weights.
        overrides: fields replacing `SKEWED_TINY` / `tests/fixtures.py`'s tiny defaults.

    Returns:
        The checkpoint directory. It also holds `skew.json` (the arguments above), which the
        engine ignores.

    Raises:
        ValueError: a hot expert id outside [0, num_experts), or config with overrides.
    """
    from transformers import AutoModelForCausalLM

    if config is not None and overrides:
        raise ValueError(f"pass either config or overrides, got both ({sorted(overrides)})")
    if config is None:
        config = tiny_config("qwen3_moe", **{**SKEWED_TINY, **overrides})
    hot = sorted(set(int(e) for e in hot_experts))
    if not hot or hot[0] < 0 or hot[-1] >= config.num_experts:
        raise ValueError(
            f"hot_experts must be ids in [0, {config.num_experts}), got {list(hot_experts)}")
    if name is None:
        suffix = "".join(f"-{k}={v}" for k, v in sorted(overrides.items())).replace(" ", "")
        hot_tag = "_".join(map(str, hot))
        name = f"skewed-qwen3_moe-h{hot_tag}-o{offset}-s{strength}-seed{seed}{suffix}"
    path = Path(root) / name
    if (path / "config.json").is_file():
        return path
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _skew(model, hot, offset, strength)
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    meta = {"hot_experts": hot, "offset": offset, "strength": strength, "seed": seed}
    (path / "skew.json").write_text(json.dumps(meta, indent=2))
    return path


def _skew(model: Any, hot: list[int], offset: float, strength: float) -> None:
    """Edit `model` in place: embedding offset, then each MoE layer's hot router rows (see
    the module docstring). Layers are done in order, since each edit changes what later
    layers' routers see."""
    config = model.config
    scale = config.initializer_range * config.hidden_size ** 0.5
    u = torch.randn(config.hidden_size, generator=torch.Generator().manual_seed(7))
    calib = torch.randint(3, config.vocab_size, _CALIB,
                          generator=torch.Generator().manual_seed(123))
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(offset * scale * u / u.norm())
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is None or not hasattr(layer.mlp, "experts"):
                continue  # a dense layer (mlp_only_layers)
            inputs = _router_inputs(model, gate, calib)
            mu = inputs.mean(dim=0)
            gate.weight[hot] += strength * scale * mu / mu.norm() ** 2


def _router_inputs(model: Any, gate: torch.nn.Module, prompts: torch.Tensor) -> torch.Tensor:
    """[tokens, hidden] float32: what `gate` sees for `prompts` ([batch, len] int64)."""
    captured: list[torch.Tensor] = []
    hook = gate.register_forward_hook(
        lambda _m, args, _out: captured.append(args[0].reshape(-1, args[0].shape[-1]).float()))
    try:
        model(prompts)
    finally:
        hook.remove()
    return captured[0]


def routing_counts(ckpt: Path, prompts: list[list[int]]) -> torch.Tensor:
    """[moe_layers, num_experts] int64: how many (token, expert) pairs each expert got from
    transformers' own router top-k over every prompt token (float32, one prompt at a time)."""
    from fixtures import _load_hf

    model = _load_hf(str(ckpt))
    counts: list[torch.Tensor] = []
    num_experts = model.config.num_experts

    def record(_m: Any, _args: Any, out: tuple) -> None:
        ids = out[2]  # Qwen3MoeTopKRouter returns (logits, scores, indices)
        counts.append(torch.bincount(ids.flatten(), minlength=num_experts))

    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    hooks = [g.register_forward_hook(record) for g in gates]
    try:
        with torch.inference_mode():
            for prompt in prompts:
                model(torch.tensor([prompt]))
    finally:
        for h in hooks:
            h.remove()
    per_layer = torch.stack(counts).reshape(len(prompts), len(gates), num_experts)
    return per_layer.sum(dim=0)


def contiguous_rank_shares(counts: torch.Tensor, ep_size: int) -> torch.Tensor:
    """[ep_size] float64: each rank's share of all pairs under the contiguous placement (rank
    r holds experts [r * E/N, (r+1) * E/N)), summed over layers.

    Args:
        counts: [moe_layers, num_experts] pairs per expert (`routing_counts`).
    """
    per_expert = counts.sum(dim=0).double()
    return per_expert.reshape(ep_size, -1).sum(dim=1) / per_expert.sum()
