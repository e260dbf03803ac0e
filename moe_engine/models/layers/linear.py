"""`Linear`: `nn.Linear` whose forward runs the kernel the registry chose for "linear".

Every dense projection of the models (QKV, output, router, dense MLP, LM head) is one of these.
`bind_kernels(plan)` takes the layer's `kernels.dense.linear.LinearKernel` from the plan once
(`KernelPlan.linear`: the native packed, bf16 and 4-bit kernels with their row thresholds, or
torch's GEMM); forward calls it with the layer's own weight and bias. An unbound layer runs
torch's GEMM. The kernel's packed copies are dropped by `reset_packed` (the model's
`load_weights` calls it, so a reload never serves stale weights).

`quantize` (`--quantized-layers all`) makes a layer compute with 4-bit weights (int4
group-wise or MXFP4 codes, as the experts' kernel reads them); `weight` keeps the checkpoint's
values: the 4-bit copy is derived from it like the packed ones (a weight update
re-quantizes).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.dense.amx import AmxLinear
from kernels.dense.linear import LinearKernel, QuantScheme
from kernels.dense.native_linear_q4 import PackedQuantLinear
from kernels.plan import KernelPlan


class Linear(nn.Linear):
    """`nn.Linear(in_features, out_features, bias, dtype=...)`; x [..., in] -> [..., out]."""

    #: Set by `bind_kernels`: what runs the layer (`KernelPlan.linear`); None: unbound.
    kernel: LinearKernel | None = None
    #: Set by `quantize`: (method, group size, scale dtype) of the 4-bit weights, else None.
    quant_scheme: QuantScheme | None = None

    def quantize(self, method: str, group_size: int, scale_dtype: torch.dtype) -> None:
        """Compute with 4-bit weights from now on: "int4" (symmetric, `group_size` values per
        `scale_dtype` scale) or "mxfp4" (blocks of 32). Quantizes once now, so a misfit fails
        at startup; call `bind_kernels` after.

        Raises:
            ValueError: an unknown method or a group size that does not divide in_features.
        """
        self.quant_scheme = (method, group_size, scale_dtype)
        self.kernel = None
        self.q4_packed()

    def bind_kernels(self, plan: KernelPlan) -> None:
        """Take the registry's kernel for this layer (`KernelPlan.linear`) and let it pack its
        copy now (`LinearKernel.prepack`: while loading, not at the first forward)."""
        self.kernel = plan.linear(self.weight, self.quant_scheme)
        self.kernel.prepack(self.weight, self.bias)

    def bound_kernel(self) -> LinearKernel:
        """The kernel that runs the layer: the bound one, else torch's (made once)."""
        if self.kernel is None:
            self.kernel = LinearKernel.torch(self.quant_scheme)
        return self.kernel

    def reset_packed(self) -> None:
        """Forget the packed copies (call after changing the weight in place)."""
        if self.kernel is not None:
            self.kernel.reset()

    def quantized_copy_bytes(self) -> int:
        """Bytes of the copies `quantize` adds beside the weight, which stays for weight
        updates: the 4-bit codes and scales (made now if `bind_kernels` dropped them: the
        first forward would), and, off the CPU, the dequantized weight once a batch beyond the
        4-bit kernel (or another backend) has made it; 0 when not quantized."""
        return self.bound_kernel().quantized_copy_bytes(self.weight, self.bias)

    def q4_packed(self) -> PackedQuantLinear:
        """The 4-bit weights (`quantize`), made on first use and kept until `reset_packed`."""
        return self.bound_kernel().q4_packed(self.weight, self.bias)

    def amx_packed(self) -> AmxLinear:
        """The weight (and bias) packed for the AMX kernel, made on first use and kept until
        `reset_packed`."""
        return self.bound_kernel().amx_packed(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel if self.kernel is not None else self.bound_kernel()
        return kernel(x, self.weight, self.bias)


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
