"""`Linear`: `nn.Linear` whose forward runs the backend the kernel registry chose for "linear".

Every dense projection of the models (QKV, output, router, dense MLP, LM head) is one of these.
Bound to the native-cpu backend (`bind_kernels`; kernels/registry.py), batches of up to
`NATIVE_MAX_ROWS` rows (`NARROW_MAX_ROWS` for layers of fewer than `NATIVE_MIN_OUT_FEATURES`
outputs, the router) go through a packed copy of the weight (kernels/dense/native_linear.py;
bfloat16
when exact: half the bytes a decode step reads; 1.3-4x torch's GEMM at 1-64 rows:
`python bench/cpu_kernels.py --only linear`, bench/NOTES.md); larger batches (long prefill
chunks) use `nn.Linear.forward`, as does the torch backend (cuBLAS on CUDA) and an unbound
layer. Where the CPU has AMX-BF16 (`kernels.dense.amx.amx_unavailable_reason`, decided once per
process), a bfloat16 layer's batches of `cpu_amx.LINEAR_MIN_ROWS` to `cpu_amx.LINEAR_MAX_ROWS`
rows run the AMX kernel instead (`AmxLinear`; 1.4-2.9x the AVX2 kernel at 1-4 rows, 5.7-9.6x
at 16, 11-17x from 64, one thread: bench/NOTES.md "AMX bf16 kernels"), the router included,
and larger batches torch's GEMM (oneDNN's AMX kernel, as fast there). The packed copies are
made on the first forward and dropped by `reset_packed` (the model's `load_weights` calls it,
so a reload never serves stale weights).

`quantize` (`--quantized-layers all`) makes a layer compute with 4-bit weights
(kernels/dense/native_linear_q4.py: int4 group-wise or MXFP4 codes, as the experts' kernel reads
them):
bound to native-cpu, every batch of up to `NATIVE_MAX_ROWS` rows runs the 4-bit kernel, and
larger ones (and every batch on another backend) torch's GEMM over the dequantized values, so
the layer computes with the same weights whatever the batch. `weight` keeps the checkpoint's
values: the 4-bit copy is derived from it like the packed ones (a weight update re-quantizes).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.dense import amx as cpu_amx
from kernels.dense.amx import AmxLinear
from kernels.dense.native_linear import PackedLinear
from kernels.dense.native_linear_q4 import PackedQuantLinear
from kernels.registry import NATIVE_CPU, KernelPlan

#: Rows above which torch's GEMM is as fast as the native kernel (bench/NOTES.md).
NATIVE_MAX_ROWS = 1024
#: Narrower layers (a router of 32 experts) are too small to split over threads: the native
#: kernel runs them on the calling thread (csrc/linear_cpu.cpp kMinParallelBytes), 3x faster
#: than torch's bfloat16 GEMM at 1-8 rows ([1, 512] x [512, 32]: 5.4 vs 17 us on one core,
#: `python bench/cpu_kernels.py --only linear`), and slower beyond.
NATIVE_MIN_OUT_FEATURES = 64
#: Rows up to which a narrow layer runs the native kernel.
NARROW_MAX_ROWS = 8


class Linear(nn.Linear):
    """`nn.Linear(in_features, out_features, bias, dtype=...)`; x [..., in] -> [..., out]."""

    _packed: PackedLinear | None = None
    _amx_packed: AmxLinear | None = None
    #: Bound by `bind_kernels`: batches of up to this many rows run the native packed kernel
    #: (0: never).
    _native_max_rows: int = 0
    #: Bound by `bind_kernels`: bfloat16 batches run the AMX kernel (`cpu_amx.amx_fits`).
    _amx: bool = False
    #: Set by `quantize`: (method, group size, scale dtype) of the 4-bit weights, else None.
    quant_scheme: tuple[str, int, torch.dtype] | None = None
    _q4_packed: PackedQuantLinear | None = None
    _q4_dense: torch.Tensor | None = None
    #: Bound by `bind_kernels`: a quantized layer on native-cpu runs the 4-bit kernel.
    _q4: bool = False

    def quantize(self, method: str, group_size: int, scale_dtype: torch.dtype) -> None:
        """Compute with 4-bit weights from now on: "int4" (symmetric, `group_size` values per
        `scale_dtype` scale) or "mxfp4" (blocks of 32). Quantizes once now, so a misfit fails
        at startup; call `bind_kernels` after.

        Raises:
            ValueError: an unknown method or a group size that does not divide in_features.
        """
        self.quant_scheme = (method, group_size, scale_dtype)
        self.reset_packed()
        self.q4_packed()

    def bind_kernels(self, plan: KernelPlan) -> None:
        """Take the registry's "linear" backend: native-cpu for a float32/bfloat16 layer, up to
        `NATIVE_MAX_ROWS` rows (`NARROW_MAX_ROWS` when it has fewer than
        `NATIVE_MIN_OUT_FEATURES` outputs), torch otherwise; and, on native-cpu, the AMX
        kernel for a bfloat16 layer where `cpu_amx.amx_fits` (any width)."""
        native = plan.backend("linear") == NATIVE_CPU
        fits = self.weight.dtype in (torch.float32, torch.bfloat16)
        wide = self.out_features >= NATIVE_MIN_OUT_FEATURES
        self._native_max_rows = (
            (NATIVE_MAX_ROWS if wide else NARROW_MAX_ROWS) if native and fits else 0
        )
        self._amx = native and cpu_amx.amx_fits(self.weight) and self.quant_scheme is None
        self._q4 = native and self.quant_scheme is not None
        self.reset_packed()

    def reset_packed(self) -> None:
        """Forget the packed copies (call after changing the weight in place)."""
        self._packed = None
        self._amx_packed = None
        self._q4_packed = None
        self._q4_dense = None

    def quantized_copy_bytes(self) -> int:
        """Bytes of the copies `quantize` adds beside the weight, which stays for weight
        updates: the 4-bit codes and scales (made now if `bind_kernels` dropped them: the
        first forward would), and the dequantized weight once a batch beyond the 4-bit kernel
        (or another backend) has made it; 0 when not quantized."""
        if self.quant_scheme is None:
            return 0
        size = self.q4_packed().nbytes
        if self._q4_dense is not None:
            size += self._q4_dense.numel() * self._q4_dense.element_size()
        return size

    def q4_packed(self) -> PackedQuantLinear:
        """The 4-bit weights (`quantize`), made on first use and kept until `reset_packed`."""
        if self._q4_packed is None:
            assert self.quant_scheme is not None, "quantize() was not called"
            method, group, scale_dtype = self.quant_scheme
            self._q4_packed = PackedQuantLinear.quantize(self.weight, self.bias, method, group,
                                                         scale_dtype)
        return self._q4_packed

    def _dequantized_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ the 4-bit weights' dequantized values.T (+ bias), torch's GEMM in x's dtype."""
        if self._q4_dense is None:
            self._q4_dense = self.q4_packed().dequantized.to(self.weight.device, x.dtype)
        return nn.functional.linear(x, self._q4_dense, self.bias)

    def amx_packed(self) -> AmxLinear:
        """The weight (and bias) packed for the AMX kernel, made on first use and kept until
        `reset_packed`."""
        if self._amx_packed is None:
            self._amx_packed = AmxLinear.pack(self.weight, self.bias)
        return self._amx_packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        if self.quant_scheme is not None:
            if self._q4 and rows <= NATIVE_MAX_ROWS:
                return self.q4_packed()(x)
            return self._dequantized_forward(x)
        if rows > NATIVE_MAX_ROWS:
            return super().forward(x)
        if self._amx and x.dtype == torch.bfloat16 and rows >= cpu_amx.LINEAR_MIN_ROWS:
            if rows > cpu_amx.LINEAR_MAX_ROWS:  # oneDNN's AMX GEMM is as fast from here
                return super().forward(x)
            return self.amx_packed()(x)
        if rows <= self._native_max_rows:
            if self._packed is None:
                self._packed = PackedLinear.pack(self.weight, self.bias)
            return self._packed(x)
        return super().forward(x)


class MergedLinear(Linear):
    """One `Linear` whose output rows are several checkpoint projections stacked (q; k; v, as
    vLLM's `QKVParallelLinear` and nano-vllm's `packed_modules_mapping` merge them).

    Args:
        in_features: input width.
        shard_sizes: output rows of each projection, by shard id in row order, e.g.
            {"q": 512, "k": 128, "v": 128}.
        bias, dtype: as `Linear`.

    Attributes:
        shards: shard id -> (first row, rows) of its slice of `weight` (and `bias`).
    """

    def __init__(
        self, in_features: int, shard_sizes: dict[str, int], bias: bool, dtype: torch.dtype
    ) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias, dtype=dtype)
        self.shards: dict[str, tuple[int, int]] = {}
        start = 0
        for shard, rows in shard_sizes.items():
            self.shards[shard] = (start, rows)
            start += rows

    def shard_view(self, param: torch.Tensor, shard: str) -> torch.Tensor:
        """The rows of `param` (this module's weight [out, in] or bias [out]) that shard
        `shard` fills.

        Raises:
            ValueError: an unknown shard id.
        """
        if shard not in self.shards:
            raise ValueError(f"shard {shard!r} is not one of {list(self.shards)}")
        start, rows = self.shards[shard]
        return param.data[start : start + rows]
