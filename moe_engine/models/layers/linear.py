"""`Linear`: `nn.Linear` whose forward runs the backend the kernel registry chose for "linear".

Every dense projection of the models (QKV, output, router, dense MLP, LM head) is one of these.
Bound to the native-cpu backend (`bind_kernels`; kernels/registry.py), batches of up to
`NATIVE_MAX_ROWS` rows (`NARROW_MAX_ROWS` for layers of fewer than `NATIVE_MIN_OUT_FEATURES`
outputs, the router) go through a packed copy of the weight (kernels/cpu_linear.py; bfloat16
when exact: half the bytes a decode step reads; 1.3-4x torch's GEMM at 1-64 rows:
`python bench/cpu_kernels.py --only linear`, bench/NOTES.md); larger batches (long prefill
chunks) use `nn.Linear.forward`, as does the torch backend (cuBLAS on CUDA) and an unbound
layer. The
packed copy is made on the first forward and dropped by `reset_packed` (the model's
`load_weights` calls it, so a reload never serves stale weights).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.cpu_linear import PackedLinear
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
    #: Bound by `bind_kernels`: batches of up to this many rows run the native packed kernel
    #: (0: never).
    _native_max_rows: int = 0

    def bind_kernels(self, plan: KernelPlan) -> None:
        """Take the registry's "linear" backend: native-cpu for a float32/bfloat16 layer, up to
        `NATIVE_MAX_ROWS` rows (`NARROW_MAX_ROWS` when it has fewer than
        `NATIVE_MIN_OUT_FEATURES` outputs), torch otherwise."""
        native = plan.backend("linear") == NATIVE_CPU and self.weight.dtype in (
            torch.float32, torch.bfloat16
        )
        wide = self.out_features >= NATIVE_MIN_OUT_FEATURES
        self._native_max_rows = (NATIVE_MAX_ROWS if wide else NARROW_MAX_ROWS) if native else 0
        self._packed = None

    def reset_packed(self) -> None:
        """Forget the packed copy (call after changing the weight in place)."""
        self._packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // max(1, x.shape[-1]) <= self._native_max_rows:
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
