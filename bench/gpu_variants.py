"""Per-op drivers of the Hopper compile check: each calls the engine's real launcher with the
tensors a served family's layer gives it, on the meta device, once per point of the sweep.

bench/gpu_compile.py runs every driver of `DRIVERS` under `gpu_recorder.record_launches`, so
each ``kernel[grid](...)`` the launcher makes becomes one compile of the check: the configs come
from the launcher itself (``get_moe_config``'s tuned table and default rule, the attention
``tile_config``, ``num_kv_splits``), never from a copy here.

Adding a Triton kernel to the check (a Triton ``moe_align_block_size``, a fused router top-k,
``moe_sum``, a fused RMSNorm, rotary + KV-cache write, ...): write one function
``driver(family, sweep) -> Iterator[Case]`` that builds its inputs (meta tensors of the layer's
real shapes and dtypes) and yields a `Case` whose ``call`` runs the op's public launcher, then
add it to `DRIVERS`. ``Case.decode`` marks launches on the decode path, where the check fails on
any register spill.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from gpu_families import Family, Sweep

META = torch.device("meta")
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Case:
    """One launcher call: ``call()`` launches; ``labels`` say what it was (family, op, dtype,
    quantization, tokens or batch, ...); ``decode``: a decode-path launch (spills fail)."""

    labels: dict[str, Any]
    call: Callable[[], object]
    decode: bool


def _empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device=META)


def _expert_weights(fam: Family, quant: str, dtype: torch.dtype, int4: tuple | None) -> dict:
    """The launcher's weight arguments for one format: w13 ``[E, 2I, H(/2)]``, w2
    ``[E, H, I(/2)]`` and their scales / zero points (layouts of kernels/moe/fused_moe.py)."""
    e, h, i = fam.num_experts, fam.hidden_size, fam.moe_intermediate_size
    if quant == "none":
        return {"w13": _empty(e, 2 * i, h, dtype=dtype), "w2": _empty(e, h, i, dtype=dtype)}
    if quant == "mxfp4":
        return {"w13_blocks": _empty(e, 2 * i, h // 32, 16, dtype=torch.uint8),
                "w13_scales": _empty(e, 2 * i, h // 32, dtype=torch.uint8),
                "w2_blocks": _empty(e, h, i // 32, 16, dtype=torch.uint8),
                "w2_scales": _empty(e, h, i // 32, dtype=torch.uint8)}  # fmt: skip
    group, scale_dtype, zeros = int4
    out = {"w13_packed": _empty(e, 2 * i, h // 2, dtype=torch.uint8),
           "w13_scales": _empty(e, 2 * i, h // group, dtype=scale_dtype),
           "w2_packed": _empty(e, h, i // 2, dtype=torch.uint8),
           "w2_scales": _empty(e, h, i // group, dtype=scale_dtype)}  # fmt: skip
    if zeros:
        out["w13_zeros"] = _empty(e, 2 * i, h // group, dtype=torch.uint8)
        out["w2_zeros"] = _empty(e, h, i // group, dtype=torch.uint8)
    return out


def _moe_formats(fam: Family, sweep: Sweep) -> Iterator[tuple[str, tuple | None, str]]:
    """(quantization, int4 variant or None, label) the family can be served with."""
    for quant in fam.quantizations:
        if quant != "int4":
            k_dims = (fam.hidden_size, fam.moe_intermediate_size)
            if quant != "mxfp4" or all(k % 32 == 0 for k in k_dims):
                yield quant, None, quant
            continue
        for group, scale_dtype, zeros in sweep.int4_variants:
            if fam.hidden_size % group or fam.moe_intermediate_size % group:
                continue  # the engine refuses this group size for the family
            label = f"int4-g{group}-{_DTYPE_NAMES[scale_dtype]}{'-zp' if zeros else ''}"
            yield quant, (group, scale_dtype, zeros), label


def fused_moe(fam: Family, sweep: Sweep) -> Iterator[Case]:
    """``kernels.moe.fused_moe.fused_moe`` / ``fused_moe_int4`` / ``fused_moe_mxfp4`` (both
    GEMMs, the config of `get_moe_config` for each token count), per dtype and format."""
    from kernels.moe import fused_moe as fm
    from kernels.moe.activation import SILU_AND_MUL, SwiGLU

    act = SwiGLU(alpha=1.702, limit=7.0) if fam.clamped_swiglu else SILU_AND_MUL
    e, h, i, k = fam.num_experts, fam.hidden_size, fam.moe_intermediate_size, fam.top_k
    launcher = {"none": fm.fused_moe, "int4": fm.fused_moe_int4, "mxfp4": fm.fused_moe_mxfp4}
    for dtype in sweep.dtypes:
        biases = {}
        if fam.clamped_swiglu:
            biases = {"b13": _empty(e, 2 * i, dtype=dtype), "b2": _empty(e, h, dtype=dtype)}
        for quant, int4, label in _moe_formats(fam, sweep):
            weights = _expert_weights(fam, quant, dtype, int4)
            for t in sweep.num_tokens:
                routing = {"topk_weights": _empty(t, k, dtype=torch.float32),
                           "topk_ids": _empty(t, k, dtype=torch.int32)}  # fmt: skip

                def call(t=t, weights=weights, routing=routing, fn=launcher[quant], b=biases,
                         dtype=dtype):  # fmt: skip
                    hidden = _empty(t, h, dtype=dtype)
                    return fn(hidden, **weights, **routing, activation=act, config=sweep.moe_config,
                              **b)  # fmt: skip

                labels = {"op": "fused_moe", "family": fam.name, "dtype": _DTYPE_NAMES[dtype],
                          "quant": label, "shape": f"T={t}"}  # fmt: skip
                # fp32 is the GPU tests' dtype (IEEE dots on FMA units, not served for speed):
                # its spills are reported, not failed
                yield Case(labels, call, decode=t <= 256 and dtype != torch.float32)


def _kv_tables(batch: int, max_len: int, block_size: int) -> dict[str, torch.Tensor]:
    width = -(-max_len // block_size)
    return {"block_tables": _empty(batch, width, dtype=torch.int64),
            "seq_lens": _empty(batch, dtype=torch.int64)}  # fmt: skip


def _attention_layers(fam: Family) -> Iterator[tuple[int | None, str]]:
    """(sliding_window, label) of the family's attention layer kinds."""
    yield None, "full"
    if fam.sliding_window is not None:
        yield fam.sliding_window, f"window{fam.sliding_window}"


def _paged_call(
    fam: Family, dtype: torch.dtype, block_size: int, num_tokens: int, batch: int, max_len: int,
    max_query_len: int, window: int | None,
) -> Callable[[], object]:  # fmt: skip
    from kernels.attention.triton_attention import paged_attention

    cache = _empty(4096, block_size, fam.num_kv_heads, fam.head_dim, dtype=dtype)
    sinks = _empty(fam.num_heads, dtype=dtype) if fam.sinks else None
    tables = _kv_tables(batch, max_len, block_size)
    q = _empty(num_tokens, fam.num_heads, fam.head_dim, dtype=dtype)
    qsl = _empty(batch + 1, dtype=torch.int64)
    return lambda: paged_attention(
        q, cache, cache, tables["block_tables"], tables["seq_lens"], qsl,
        scale=fam.head_dim**-0.5, max_query_len=max_query_len, sliding_window=window, sinks=sinks,
    )  # fmt: skip


def attention_decode(fam: Family, sweep: Sweep) -> Iterator[Case]:
    """``paged_attention`` decode (``max_query_len`` 1) at each CUDA-graph batch size over
    block tables ``max_model_len`` wide: the split count of ``num_kv_splits`` and, when > 1,
    ``merge_kv_splits_kernel``."""
    if fam.is_mla:
        return
    for dtype in sweep.dtypes:
        for window, layer in _attention_layers(fam):
            for max_len in sweep.max_model_lens:
                max_len = max_len or fam.max_position_embeddings
                if max_len > fam.max_position_embeddings:
                    continue
                for batch in sweep.decode_batches:
                    call = _paged_call(fam, dtype, sweep.block_size, batch, batch, max_len, 1,
                                       window)  # fmt: skip
                    labels = {
                        "op": "attention_decode",
                        "family": fam.name,
                        "quant": layer,
                        "dtype": _DTYPE_NAMES[dtype],
                        "shape": f"B={batch} len={max_len}",
                    }
                    yield Case(labels, call, decode=True)


def attention_prefill(fam: Family, sweep: Sweep) -> Iterator[Case]:
    """``paged_attention`` over one prefill chunk of T tokens (``max_query_len`` T > 1)."""
    if fam.is_mla:
        return  # MLA prefill chunks run on torch (models/layers/mla.py)
    for dtype in sweep.dtypes:
        for window, layer in _attention_layers(fam):
            for t in sweep.num_tokens:
                if t < 2:
                    continue
                call = _paged_call(fam, dtype, sweep.block_size, t, 1,
                                   fam.max_position_embeddings, t, window)  # fmt: skip
                labels = {"op": "attention_prefill", "family": fam.name, "quant": layer,
                          "dtype": _DTYPE_NAMES[dtype], "shape": f"T={t}"}  # fmt: skip
                yield Case(labels, call, decode=False)


def mla_decode(fam: Family, sweep: Sweep) -> Iterator[Case]:
    """``mla_decode`` over the latent cache ``[blocks, block_size, rank + rope]`` at each
    CUDA-graph batch size and block-table width (its splits and their merge)."""
    if not fam.is_mla:
        return
    from kernels.attention.triton_attention import mla_decode as launcher

    width = fam.kv_lora_rank + fam.rope_dim
    for dtype in sweep.dtypes:
        cache = _empty(4096, sweep.block_size, width, dtype=dtype)
        for max_len in sweep.max_model_lens:
            max_len = max_len or fam.max_position_embeddings
            for batch in sweep.decode_batches:
                tables = _kv_tables(batch, max_len, sweep.block_size)
                q = _empty(batch, fam.num_heads, width, dtype=dtype)

                def call(q=q, tables=tables, cache=cache):
                    return launcher(q, cache, tables["block_tables"], tables["seq_lens"],
                                    scale=0.1, kv_lora_rank=fam.kv_lora_rank)  # fmt: skip

                labels = {
                    "op": "mla_decode",
                    "family": fam.name,
                    "quant": "mla",
                    "dtype": _DTYPE_NAMES[dtype],
                    "shape": f"B={batch} len={max_len}",
                }
                yield Case(labels, call, decode=True)


#: Each family's routing rule (the name `KernelPlan.router_topk` takes) and its arguments after
#: (logits, top_k), from the models' config.json: DeepSeek-V3's noaux_tc (n_group 8, topk_group
#: 4, norm_topk_prob, routed_scaling_factor 2.5, float32 logits and correction bias).
_ROUTINGS: dict[str, tuple[str, tuple]] = {
    "gpt-oss": ("topk_softmax", ()),
    "DeepSeek-V3": ("sigmoid_grouped_topk", ("bias", 8, 4, True, 2.5)),
}


def router_topk(fam: Family, sweep: Sweep) -> Iterator[Case]:
    """``kernels.moe.router_kernels``' fused router of the family's rule, per token count.
    (`moe_align_block_size_kernel` and `moe_sum_kernel` are launched by ``fused_moe``'s
    launcher, so the ``fused_moe`` driver records them.)"""
    from kernels.moe.router_kernels import FUSED_ROUTERS

    name, extra = next(
        (rule for prefix, rule in _ROUTINGS.items() if fam.name.startswith(prefix)),
        ("softmax_topk", (True,)),
    )
    for dtype in sweep.dtypes:
        logits_dtype = torch.float32 if name == "sigmoid_grouped_topk" else dtype
        args = tuple(_empty(fam.num_experts, dtype=torch.float32) if a == "bias" else a
                     for a in extra)  # fmt: skip
        counts = _empty(fam.num_experts, dtype=torch.int64)
        for t in sweep.num_tokens:
            logits = _empty(t, fam.num_experts, dtype=logits_dtype)
            # without and with the expert-load count (the engine counts in the router's launch)
            for counting in (False, True):

                def call(logits=logits, args=args, counting=counting, counts=counts):
                    return FUSED_ROUTERS[name](logits, fam.top_k, *args,
                                               expert_counts=counts if counting else None)

                labels = {"op": "router_topk", "family": fam.name,
                          "quant": name + (" +counts" if counting else ""),
                          "dtype": _DTYPE_NAMES[logits_dtype], "shape": f"T={t}"}  # fmt: skip
                yield Case(labels, call, decode=t <= 256)


def silu_and_mul(fam: Family, sweep: Sweep) -> Iterator[Case]:
    """``kernels.dense.triton_act.silu_and_mul`` over the shared experts' merged gate/up
    output (``[T, 2I]``, I = the routed experts' intermediate size, as DeepSeek's one shared
    expert of n_shared x I: the widest width the families use it at), per dtype and tokens."""
    if not fam.is_mla:
        return
    from kernels.dense.triton_act import silu_and_mul as launcher

    for dtype in sweep.dtypes:
        for t in sweep.num_tokens:
            x = _empty(t, 2 * fam.moe_intermediate_size, dtype=dtype)

            def call(x=x):
                return launcher(x)

            labels = {"op": "silu_and_mul", "family": fam.name, "quant": "shared experts",
                      "dtype": _DTYPE_NAMES[dtype], "shape": f"T={t}"}  # fmt: skip
            yield Case(labels, call, decode=t <= 256)


def mla_rope_cache(fam: Family, sweep: Sweep) -> Iterator[Case]:
    """``kernels.attention.triton_mla_prologue.mla_rope_cache``: MLA's prologue (the latent's
    RMSNorm, rope of k_pe and every head's q_pe, the latent written at ``slot_mapping``)."""
    if not fam.is_mla:
        return
    from kernels.attention.triton_mla_prologue import mla_rope_cache as launcher

    rank, rope, heads = fam.kv_lora_rank, fam.rope_dim, fam.num_heads
    for dtype in sweep.dtypes:
        tables = _empty(4096, rope, dtype=torch.float32)
        cache = _empty(4096, sweep.block_size, rank + rope, dtype=dtype)
        norm = _empty(rank, dtype=dtype)
        for t in sweep.num_tokens:
            kv_a = _empty(t, rank + rope, dtype=dtype)
            q = _empty(t, heads, 128 + rope, dtype=dtype)  # q_nope (128) then q_pe
            index = _empty(t, dtype=torch.int64)

            def call(kv_a=kv_a, q=q, index=index, tables=tables, cache=cache, norm=norm):
                return launcher(kv_a, q[..., 128:], index, tables, tables, norm, 1e-6, cache,
                                index, True)  # fmt: skip

            labels = {"op": "mla_rope_cache", "family": fam.name, "quant": f"rope{rope}",
                      "dtype": _DTYPE_NAMES[dtype], "shape": f"T={t}"}  # fmt: skip
            yield Case(labels, call, decode=t <= 256)


def rms_norm(fam: Family, sweep: Sweep) -> Iterator[Case]:
    """``kernels.dense.triton_norm``'s ``rms_norm`` and ``fused_add_rms_norm`` over the hidden
    size, per dtype and token count (gpt-oss rounds with the weight in float32). The rotary +
    KV-cache prologues have their own drivers below."""
    from kernels.dense.triton_norm import fused_add_rms_norm
    from kernels.dense.triton_norm import rms_norm as launcher

    h, fp32_weight = fam.hidden_size, fam.clamped_swiglu
    for dtype in sweep.dtypes:
        weight = _empty(h, dtype=torch.float32 if fp32_weight else dtype)
        for t in sweep.num_tokens:
            x, res = _empty(t, h, dtype=dtype), _empty(t, h, dtype=dtype)
            for name in ("rms_norm", "fused_add_rms_norm"):

                def call(x=x, res=res, weight=weight, name=name):
                    if name == "rms_norm":
                        return launcher(x, weight, 1e-6, fp32_weight)
                    return fused_add_rms_norm(x, res, weight, 1e-6, fp32_weight)

                labels = {"op": "rms_norm", "family": fam.name, "quant": name,
                          "dtype": _DTYPE_NAMES[dtype], "shape": f"T={t}"}  # fmt: skip
                yield Case(labels, call, decode=t <= 256)


def qk_norm_rope_cache(fam: Family, sweep: Sweep) -> Iterator[Case]:
    """``kernels.dense.triton_rope.qk_norm_rope_cache``: the attention prologue (q/k RMSNorm
    for the Qwen3 families, rotary over the whole head, Qwen3-Next's over a quarter, K/V
    written at ``slot_mapping``) per dtype and token count (MLA's: `mla_rope_cache`)."""
    if fam.is_mla:
        return
    from kernels.dense.triton_rope import qk_norm_rope_cache as launcher

    hq, hkv, d = fam.num_heads, fam.num_kv_heads, fam.head_dim
    rot = d // 4 if fam.name.startswith("Qwen3-Next") else d
    qk_norm = fam.name.startswith("Qwen3")
    for dtype in sweep.dtypes:
        tables = _empty(4096, rot, dtype=torch.float32)
        cache = _empty(4096, sweep.block_size, hkv, d, dtype=dtype)
        norm = _empty(d, dtype=dtype) if qk_norm else None
        for t in sweep.num_tokens:
            qkv = _empty(t, (hq + 2 * hkv) * d, dtype=dtype)
            index = _empty(t, dtype=torch.int64)

            def call(qkv=qkv, index=index, tables=tables, cache=cache, norm=norm):
                return launcher(qkv, hq, hkv, index, tables, tables, norm, norm, 1e-6, cache,
                                cache, index)  # fmt: skip

            labels = {"op": "qk_norm_rope_cache", "family": fam.name, "quant": f"rot{rot}",
                      "dtype": _DTYPE_NAMES[dtype], "shape": f"T={t}"}  # fmt: skip
            yield Case(labels, call, decode=t <= 256)


#: Every driver the check runs, in report order.
DRIVERS: tuple[Callable[[Family, Sweep], Iterator[Case]], ...] = (
    fused_moe,
    attention_decode,
    attention_prefill,
    mla_decode,
    router_topk,
    rms_norm,
    qk_norm_rope_cache,
    silu_and_mul,
    mla_rope_cache,
)
