"""`KernelPlan`: the backend of every op for one device, and the kernel objects it hands the
layers (`linear`, `attention`, `rms_norm`, ...), each with the fallbacks it may take declared
(`fallbacks`) and printed in the startup plan. `kernels.registry.choose_kernels` makes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kernels.attention.paged import PagedAttentionKernels
    from kernels.decode_layer.native import DecodeLayerKernel
    from kernels.dense.linear import LinearKernel, QuantScheme
    from kernels.moe.backends import BoundExperts, ExpertExtras

NATIVE_CPU, TORCH, TRITON = "native-cpu", "torch", "triton"
#: Every backend, in auto's order of preference where several could run an op.
BACKENDS = (NATIVE_CPU, TRITON, TORCH)

#: The ops a backend is chosen for.
OPS = (
    "fused_moe",  # routed experts, float weights (bf16 / fp16 / fp32); triton: also the
    # shared experts' silu_and_mul (`KernelPlan.silu_and_mul`)
    "fused_moe_int4",  # routed experts, int4 group-wise weights
    "fused_moe_mxfp4",  # routed experts, MXFP4 weights
    "attention_prefill",  # paged attention, multi-token queries (prefill chunks)
    "attention_decode",  # paged attention, one query token per request
    "mla_decode",  # MLA absorbed decode over the latent cache
    "linear",  # dense projections (QKV, output, router, dense MLP, LM head)
    "rms_norm",  # (triton: also fused with the residual add before it)
    "rotary",  # rope with q/k norm and the KV-cache write, one call per layer (torch: module ops)
    "router_topk",  # routing: scores, the top-k selection (lower id on ties), the weights
    "decode_layer",  # a whole decoder layer of a decode step (native-cpu: one call)
)

#: The routed experts' op per `--quantization` method.
EXPERT_OPS = {"none": "fused_moe", "int4": "fused_moe_int4", "mxfp4": "fused_moe_mxfp4"}

#: Which ops each backend implements.
IMPLEMENTS: dict[str, frozenset[str]] = {
    NATIVE_CPU: frozenset(
        {"fused_moe", "fused_moe_int4", "fused_moe_mxfp4", "attention_prefill",
         "attention_decode", "linear", "rms_norm", "rotary", "router_topk", "decode_layer"}
    ),
    TORCH: frozenset(OPS),
    TRITON: frozenset(
        {"fused_moe", "fused_moe_int4", "fused_moe_mxfp4", "attention_prefill",
         "attention_decode", "mla_decode", "rms_norm", "rotary", "router_topk"}
    ),
}

@dataclass(frozen=True)
class KernelChoice:
    """One op's backend and why it was chosen (for the startup log)."""

    op: str
    backend: str
    reason: str


@dataclass(frozen=True)
class KernelPlan:
    """The backend of every op, for one device.

    Attributes:
        device: "cpu" or "cuda".
        choices: op -> its `KernelChoice`, for every op of `OPS`.
        native_isa: where an op runs native-cpu, the library variant and why it was chosen
            (`kernels.native.library.loaded_isa`, e.g. "avx512 (auto: this CPU has avx512f, ...)");
            else "".
    """

    device: str
    choices: dict[str, KernelChoice] = field(default_factory=dict)
    native_isa: str = ""

    def backend(self, op: str) -> str:
        """The backend name that runs `op`.

        Raises:
            KeyError: an op not in `OPS`.
        """
        return self.choices[op].backend

    def as_dict(self) -> dict[str, str]:
        """op -> backend."""
        return {op: c.backend for op, c in self.choices.items()}

    def info(self) -> dict[str, str]:
        """What GetModelInfo returns as kernel_backends: `as_dict`, plus "native_cpu_isa" ->
        "avx2" or "avx512" where an op runs native-cpu."""
        out = self.as_dict()
        if self.native_isa:
            out["native_cpu_isa"] = self.native_isa.split()[0]
        return out

    def describe(self, used: Iterable[str] | None = None) -> str:
        """One line for the startup plan, e.g. "kernels (cpu): fused_moe=native-cpu, ...";
        choices that fell back say why on their own lines, and each kernel the model uses
        (`used`: op names; None: every op) the routes it may take per call
        (`fallbacks`)."""
        used = set(OPS if used is None else used)
        pairs = ", ".join(f"{op}={c.backend}" for op, c in self.choices.items())
        by_reason: dict[str, list[str]] = {}
        for c in self.choices.values():
            if c.reason:
                by_reason.setdefault(c.reason, []).append(c.op)
        notes = [f"  {', '.join(ops)}: {reason}" for reason, ops in by_reason.items()]
        for c in self.choices.values():
            for fallback in fallbacks(c.op, c.backend) if c.op in used else ():
                notes.append(f"  {c.op}={c.backend}, per call: {fallback}")
        if self.native_isa:
            notes.append(f"  native-cpu build: {self.native_isa}")
        return "\n".join([f"kernels ({self.device}): {pairs}", *notes])

    # ------------------------------------------------------------ the kernel objects

    def linear(self, weight: torch.Tensor, quant_scheme: QuantScheme | None) -> LinearKernel:
        """What runs a dense projection of `weight` [out, in] (4-bit when `quant_scheme`):
        the "linear" backend's routes, with the fallbacks `fallbacks("linear", ...)` names."""
        from kernels.dense.linear import LinearKernel

        if self.backend("linear") == NATIVE_CPU:
            return LinearKernel.native(weight, quant_scheme)
        return LinearKernel.torch(quant_scheme)

    def attention(self, num_heads: int, num_kv_heads: int) -> PagedAttentionKernels:
        """The decode and prefill kernels of a paged attention layer of `num_heads` query
        heads over `num_kv_heads` KV heads (a layer whose GQA ratio the native prefill
        kernel does not take gets the torch path, as `choose_kernels` decides for the model)."""
        from kernels.attention import paged

        kernel_of = {NATIVE_CPU: (paged.native_decode, paged.native_prefill),
                     TRITON: (paged.triton_paged, paged.triton_paged)}
        decode_backend = self.backend("attention_decode")
        prefill_backend = self.backend("attention_prefill")
        decode = kernel_of.get(decode_backend, (None, None))[0]
        prefill = kernel_of.get(prefill_backend, (None, None))[1]
        if prefill is paged.native_prefill and (
            num_heads // num_kv_heads > paged.NATIVE_PREFILL_MAX_GQA
        ):
            prefill, prefill_backend = None, TORCH
        return paged.PagedAttentionKernels(decode, prefill, decode_backend, prefill_backend)

    def mla_decode(self) -> Callable[..., Any] | None:
        """The absorbed MLA decode kernel (`triton_attention.mla_decode`), or None: the
        layer's torch path."""
        if self.backend("mla_decode") != TRITON:
            return None
        from kernels.attention.triton_attention import mla_decode

        return mla_decode

    def indexer_scores(self) -> Callable[..., Any] | None:
        """The lightning indexer's paged scoring kernel (`triton_indexer.indexer_scores`,
        DeepSeek Sparse Attention), chosen with its attention's "mla_decode" backend; None:
        the layer's torch path."""
        if self.backend("mla_decode") != TRITON:
            return None
        from kernels.attention.triton_indexer import indexer_scores

        return indexer_scores

    def rms_norm(self, weight: torch.Tensor) -> Callable[..., Any] | None:
        """The fused RMSNorm for `weight`, called `(x, weight, eps, weight_in_float32)`:
        native-cpu `kernels.dense.ops.rms_norm` (float32/bfloat16 weights), triton
        `kernels.dense.triton_norm.rms_norm` (float weights); or None: the layer's torch ops."""
        import torch

        backend = self.backend("rms_norm")
        if backend == NATIVE_CPU and weight.dtype in (torch.float32, torch.bfloat16):
            from kernels.dense.ops import rms_norm

            return rms_norm
        if backend == TRITON and weight.is_floating_point():
            from kernels.dense.triton_norm import rms_norm as triton_rms_norm

            return triton_rms_norm
        return None

    def add_rms_norm(self, weight: torch.Tensor) -> Callable[..., Any] | None:
        """The residual add fused with the RMSNorm after it (vLLM's `fused_add_rms_norm`),
        called `(x, residual, weight, eps, weight_in_float32) -> (normed, x + residual)`:
        triton `kernels.dense.triton_norm.fused_add_rms_norm`; or None: the add, then
        `rms_norm`'s kernel or the torch ops."""
        if self.backend("rms_norm") != TRITON or not weight.is_floating_point():
            return None
        from kernels.dense.triton_norm import fused_add_rms_norm

        return fused_add_rms_norm

    def silu_and_mul(self) -> Callable[..., Any] | None:
        """The SwiGLU activation of a merged gate/up projection, called `(x [T, 2I]) -> [T, I]`
        (`silu(gate) * up`, rounded as the torch ops): triton
        `kernels.dense.triton_act.silu_and_mul` where the float experts run triton (the shared
        experts are experts; one op keeps their activation on the routed experts' backend);
        or None: the layer's separate projections and torch ops."""
        if self.backend("fused_moe") != TRITON:
            return None
        from kernels.dense.triton_act import silu_and_mul

        return silu_and_mul

    def router_topk(
        self, device_type: str, routing: str = "softmax_topk"
    ) -> Callable[..., Any] | None:
        """The one-call routing of the rule `routing` (the name of its torch function in
        `moe_engine.models.layers.routing`: "softmax_topk", "topk_softmax",
        "sigmoid_grouped_topk", "softmax_grouped_topk"; the kernel takes the same arguments)
        for a router on `device_type`, or None: the torch function. triton: the fused router
        of `kernels.moe.router_kernels` (every rule); native-cpu: `kernels.dense.ops.
        router_softmax_topk` ("softmax_topk" on a CPU only)."""
        backend = self.backend("router_topk")
        if backend == TRITON:
            from kernels.moe.router_kernels import FUSED_ROUTERS

            return FUSED_ROUTERS.get(routing)
        if backend != NATIVE_CPU or device_type != "cpu" or routing != "softmax_topk":
            return None
        from kernels.dense.ops import router_softmax_topk

        return router_softmax_topk

    def rope_prologue(
        self, *, interleaved: bool = False, partial: bool = False
    ) -> Callable[..., Any] | None:
        """The one-call attention prologue (split of the fused QKV output, q/k norm, rope, the
        KV-cache write), with the contract of `kernels.dense.ops.qk_norm_rope_cache`, for a
        rope on `interleaved` pairs and over `partial` heads (tables narrower than the head):
        native-cpu's (neither), triton's `kernels.dense.triton_rope.qk_norm_rope_cache`
        (both; called with `interleaved=True` for that layout); or None: the module path."""
        backend = self.backend("rotary")
        if backend == NATIVE_CPU and not (interleaved or partial):
            from kernels.dense.ops import qk_norm_rope_cache

            return qk_norm_rope_cache
        if backend == TRITON:
            from kernels.dense.triton_rope import qk_norm_rope_cache as triton_prologue

            return triton_prologue
        return None

    def mla_rope_prologue(self) -> Callable[..., Any] | None:
        """An MLA layer's one-call prologue (`kv_a_layernorm`, rope of k_pe and q_pe, the
        latent-cache write): triton's `kernels.attention.triton_mla_prologue.mla_rope_cache`,
        or None: the layer's module path."""
        if self.backend("rotary") != TRITON:
            return None
        from kernels.attention.triton_mla_prologue import mla_rope_cache

        return mla_rope_cache

    def decode_layer(self) -> type[DecodeLayerKernel] | None:
        """The one-call native decode layer, or None: every layer module by module."""
        if self.backend("decode_layer") != NATIVE_CPU:
            return None
        from kernels.decode_layer.native import DecodeLayerKernel

        return DecodeLayerKernel

    def float_experts(
        self, w13: torch.Tensor, w2: torch.Tensor, extras: ExpertExtras
    ) -> BoundExperts:
        """Float experts (w13 [E, 2I, H], w2 [E, H, I]) bound to the "fused_moe" backend."""
        from kernels.moe.backends import bind_float_experts

        return bind_float_experts(self.backend("fused_moe"), w13, w2, extras)

    def quantized_experts(self, method: str, weights: Any) -> BoundExperts:
        """4-bit experts ("int4" `Int4Experts`, "mxfp4" `Mxfp4Experts`) bound to the
        backend of their op ("fused_moe_int4" / "fused_moe_mxfp4")."""
        from kernels.moe.backends import bind_int4_experts, bind_mxfp4_experts

        bind = bind_int4_experts if method == "int4" else bind_mxfp4_experts
        return bind(self.backend(EXPERT_OPS[method]), weights)

    def linear_copy_bytes(self, weight_dtype: torch.dtype) -> float:
        """Bytes per weight of the copy the "linear" kernel packs beside a float dense
        projection of a `weight_dtype` checkpoint at its first forward (`LinearKernel`): 2 for
        bfloat16 values (the bf16 kernel's tiles, or the packed kernel's bfloat16 tiles, also
        when they are computed in float32), 4 for float32 ones, 0 where torch's GEMM runs
        (torch backends, float16)."""
        import torch

        if self.backend("linear") != NATIVE_CPU:
            return 0.0
        return {torch.bfloat16: 2.0, torch.float32: 4.0}.get(weight_dtype, 0.0)

    def expert_copy_bytes(self, weight_dtype: torch.dtype) -> float:
        """Bytes per weight of the copy the float "fused_moe" kernel packs beside the experts'
        `weight_dtype` parameters at bind time (`kernels.moe.backends.bind_float_experts`: the
        parameters stay, for in-place weight updates): 2 for bfloat16 (AMX tiles or the
        packed kernel's bfloat16 tiles), 4 for float32 (kept float32 unless exactly bfloat16:
        counted at its most), 0 where torch or triton read the parameters in place."""
        import torch

        if self.backend("fused_moe") != NATIVE_CPU:
            return 0.0
        return {torch.bfloat16: 2.0, torch.float32: 4.0}.get(weight_dtype, 4.0)

    def keeps_experts(self, method: str, bound: BoundExperts | None) -> bool:
        """Whether binding `bound` (4-bit experts of `method`) again under this plan changes
        nothing: a layout that cannot be converted back (torch's int4 CPU layout) bound to the
        same backend again."""
        return (bound is not None and bound.restore is None
                and self.backend(EXPERT_OPS[method]) == bound.backend)

    def graph_unsafe(self, ops: list[str]) -> list[str]:
        """"op=backend" for each of `ops` whose kernel cannot be captured in a CUDA graph
        (only the Triton kernels are launch-only: the others read lengths on the host)."""
        return [f"{op}={self.backend(op)}" for op in dict.fromkeys(ops)
                if self.backend(op) != TRITON]

    def compiled_on_launch(self, ops: Iterable[str]) -> list[str]:
        """Those of `ops` whose kernel is compiled at its first launch per variant (Triton's
        JIT): what a startup warm-up compiles before the first request
        (`moe_engine.runner.warmup`)."""
        return [op for op in dict.fromkeys(ops) if self.backend(op) == TRITON]

    @classmethod
    def uniform(cls, backend: str, device: str = "cpu") -> KernelPlan:
        """Every op on `backend` where it implements it, torch elsewhere; nothing is probed
        (for tests that build modules directly)."""
        choices = {
            op: KernelChoice(op, backend if op in IMPLEMENTS[backend] else TORCH, "")
            for op in OPS
        }
        return cls(device, choices)


def fallbacks(op: str, backend: str) -> tuple[str, ...]:
    """The conditions under which `op`'s kernel on `backend` hands a call to another kernel
    (declared by each kernel module beside the code that takes them; the startup plan prints
    them): () for a kernel that runs every call it is given."""
    if backend == TRITON:
        return _TRITON_FALLBACKS.get(op, ())
    if backend != NATIVE_CPU:
        return ()
    if op == "linear":
        from kernels.dense.linear import native_fallbacks

        return native_fallbacks()
    if op == "attention_prefill":
        from kernels.attention.paged import NATIVE_PREFILL_FALLBACKS

        return NATIVE_PREFILL_FALLBACKS
    if op == "fused_moe":
        from kernels.moe.backends import native_float_variants

        return native_float_variants()
    if op == "decode_layer":
        from kernels.decode_layer.native import MAX_ROWS

        return (f"steps with prefills or over {MAX_ROWS} rows, and layers the kernel does "
                f"not implement (the log lists them): module by module",)
    if op == "rms_norm":
        return ("inputs of more than 3 dimensions or another dtype than the weight's: torch",)
    if op == "rotary":
        return ("layers with another rope (interleaved pairs, partial rotary) or q/k norms the "
                "kernel does not round like Qwen3's, and steps whose K/V dtype differs from the "
                "projections': the module path",)
    if op == "router_topk":
        return ("routers other than softmax-then-top-k (gpt-oss's top-k-then-softmax, grouped "
                "sigmoid routing): their own torch code",)
    return ()


#: The per-call routes of the triton backend's small ops (kernels/dense/triton_norm.py,
#: triton_rope.py, kernels/attention/triton_mla_prologue.py).
_TRITON_FALLBACKS = {
    "mla_decode": ("decode rows of a sparse-attention layer (DeepSeek Sparse Attention) whose "
                   "context exceeds index_topk keys: the torch absorbed path over the keys the "
                   "indexer (Triton scores, torch.topk) selected",),
    "fused_moe": ("non-gated (relu^2) experts, Nemotron-H's: the torch expert path (the "
                  "Triton fused MoE kernel computes SwiGLU only)",),
    "rms_norm": ("norms other than RMSNorm (Qwen3-Next's zero-centred and gated ones), inputs "
                 "of more than 3 dimensions or another dtype than the weight's (the fused add: "
                 "a residual of another dtype or shape): torch",),
    "rotary": ("layers whose q/k norms (MLA: kv_a_layernorm) do not round like Qwen3's (a "
               "float32 weight product, two epsilons), Qwen3-Next's gated attention, and steps "
               "whose K/V cache dtype differs from the projections': the module path",),
}
