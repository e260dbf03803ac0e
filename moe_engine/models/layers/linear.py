"""`Linear`: `nn.Linear` whose CPU forward runs the native packed kernel (kernels/cpu_linear.py).

Every dense projection of the models (QKV, output, router, dense MLP, LM head) is one of these.
On a CPU with the native kernels built, batches of up to `NATIVE_MAX_ROWS` rows of layers with
at least `NATIVE_MIN_OUT_FEATURES` outputs go through a packed copy of the weight (bfloat16
when exact: half the bytes a decode step reads; 1.3-4x torch's GEMM at 1-64 rows:
`python bench/cpu_kernels.py --only linear`, bench/NOTES.md); larger batches (long prefill
chunks), narrow layers (the router), other devices and a missing kernel use
`nn.Linear.forward`. The packed copy is made on the first forward and dropped by
`reset_packed` (the model's `load_weights` calls it, so a reload never serves stale weights).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.cpu_linear import PackedLinear, native_linear_available

#: Rows above which torch's GEMM is as fast as the native kernel (bench/NOTES.md).
NATIVE_MAX_ROWS = 1024
#: Narrower layers (a router of 32 experts: 0.3-0.9x torch at 1-8 rows,
#: `python bench/cpu_kernels.py --only linear`) stay on torch's GEMM.
NATIVE_MIN_OUT_FEATURES = 64


class Linear(nn.Linear):
    """`nn.Linear(in_features, out_features, bias, dtype=...)`; x [..., in] -> [..., out]."""

    _packed: PackedLinear | None = None

    def reset_packed(self) -> None:
        """Forget the packed copy (call after changing the weight in place)."""
        self._packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        if (
            x.device.type == "cpu"
            and rows <= NATIVE_MAX_ROWS
            and self.out_features >= NATIVE_MIN_OUT_FEATURES
            and x.dtype in (torch.float32, torch.bfloat16)
            and (self._packed is not None or native_linear_available())
        ):
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
