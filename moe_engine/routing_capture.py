"""Routing replay, the device half: one step's top-k expert ids of every MoE layer.

`RoutedExpertsCapture` holds one device buffer `[capacity, num_moe_layers, top_k]` (int16 where
the router's expert ids fit, else int32) that each MoE layer writes its router's `topk_ids`
into (one `copy_` per layer, no host sync, CUDA-graph capturable: the buffer's address never
changes while it is large enough); the model runner reads the step's rows back to the host
once per step (`take`, one device-to-host copy) and keeps them per KV slot
(`moe_engine.kv_cache.routed_experts`). The ids are logical expert ids as the router returns
them: before any placement or replica mapping (expert parallelism, EPLB) and before
zero-computation experts are split off (LongCat-Flash: their ids are E.. E + Z - 1).

The idea is SGLang's `RoutedExpertsCapturer` (python/sglang/srt/layers/moe/
routed_experts_capturer.py: a device buffer per step written by each layer's top-k, copied to a
host buffer indexed by KV-pool slot); vLLM's `--enable-return-routed-experts` returns the same
`[tokens, layers, top_k]` array.
"""

from __future__ import annotations

import numpy as np
import torch

#: The largest expert id an int16 buffer holds.
INT16_MAX_ID = int(torch.iinfo(torch.int16).max)


class RoutedExpertsCapture:
    """The step's routing of every recorded MoE layer, on the device.

    Args:
        num_layers: L, the recorded MoE layers (the main model's; MTP/draft layers are never
            recorded); row r of the buffer's second dimension is the r-th of them.
        top_k: k, the largest experts per token of any recorded layer (a layer with fewer
            leaves -1 in the columns past its own).
        num_scored_experts: how many ids the routers choose from (routed plus
            zero-computation experts): int16 when they all fit, else int32.
        capacity: token rows the buffer holds at first (the largest step expected); a larger
            step grows it (a shape check, no sync), which moves it: size it for the
            CUDA-graph sizes before capturing.
        device: the model's device.

    Raises:
        ValueError: num_layers, top_k or capacity below 1.
    """

    def __init__(self, num_layers: int, top_k: int, num_scored_experts: int, capacity: int,
                 device: torch.device | str | None = None) -> None:
        if num_layers < 1 or top_k < 1 or capacity < 1:
            raise ValueError(
                f"routed experts capture: num_layers ({num_layers}), top_k ({top_k}) and "
                f"capacity ({capacity}) must be >= 1"
            )
        self.num_layers, self.top_k = num_layers, top_k
        self.dtype = torch.int16 if num_scored_experts - 1 <= INT16_MAX_ID else torch.int32
        self.device = torch.device(device or "cpu")
        self.buffer = self._allocate(capacity)

    def _allocate(self, capacity: int) -> torch.Tensor:
        """[capacity, L, k] of -1 (the columns a smaller-k layer never writes stay -1)."""
        return torch.full((capacity, self.num_layers, self.top_k), -1, dtype=self.dtype,
                          device=self.device)

    @property
    def capacity(self) -> int:
        """Token rows the buffer holds now."""
        return self.buffer.shape[0]

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's routing takes (L * k * itemsize)."""
        return self.num_layers * self.top_k * self.buffer.element_size()

    def record(self, row: int, topk_ids: torch.Tensor) -> None:
        """Write one MoE layer's routing of this step's tokens.

        Args:
            row: the layer's row (0..L-1).
            topk_ids: [T, k_layer] integer expert ids as the router chose them, on the
                buffer's device (T may exceed the real tokens: padded graph rows).
        """
        t, k = topk_ids.shape
        if t > self.capacity:
            self.buffer = torch.cat([self.buffer, self._allocate(max(t, 2 * self.capacity)
                                                                 - self.capacity)])
        self.buffer[:t, row, :k].copy_(topk_ids)

    def record_layers(self, rows: list[int], topk_ids: torch.Tensor) -> None:
        """Write several layers' routing at once (the native decode layers).

        Args:
            rows: the layers' rows; topk_ids: [len(rows), T, k] int32.
        """
        for i, row in enumerate(rows):
            self.record(row, topk_ids[i])

    def take(self, num_tokens: int) -> np.ndarray:
        """The step's first `num_tokens` rows on the host: [T, L, k] int16/int32 (the step's one
        device-to-host copy; on a CPU a view of the buffer, valid until the next forward)."""
        return self.buffer[:num_tokens].to("cpu").numpy()
