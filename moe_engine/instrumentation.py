"""Routing-load instrumentation: how many tokens each expert of each MoE layer received.

`ExpertLoadRecorder` keeps one counter tensor `[num_moe_layers, num_experts]` (int64, on the
device the model runs on) that each MoE layer adds its `topk_ids` histogram to (one `bincount`
per layer per step, no host sync); readers copy it out when they ask. The summaries use the two
conventions the field uses: `imbalance_ratio` = max / mean and `balancedness` = mean / max
(DeepSeek EPLB, SGLang's expert-distribution recorder).
"""

from __future__ import annotations

import torch


class ExpertLoadRecorder:
    """Accumulates tokens per (MoE layer, expert).

    Args:
        moe_layers: the decoder-layer indices of the MoE layers, in order.
        num_experts: E, experts per MoE layer.
    """

    def __init__(self, moe_layers: list[int], num_experts: int) -> None:
        self.moe_layers = list(moe_layers)
        self.row_of_layer = {layer: row for row, layer in enumerate(self.moe_layers)}
        self.num_experts = num_experts
        self.counts = torch.zeros(len(self.moe_layers), num_experts, dtype=torch.int64)

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Add one step's routing of decoder layer `layer`.

        Args:
            topk_ids: [T, k] int32 global expert ids as the router chose them, all in [0, E).
        """
        ids = topk_ids.reshape(-1)
        self.counts[self.row_of_layer[layer]] += torch.bincount(ids, minlength=self.num_experts)

    def snapshot(self) -> torch.Tensor:
        """A copy of the counters: [num_moe_layers, num_experts] int64 tokens."""
        return self.counts.clone()

    def reset(self) -> None:
        self.counts.zero_()


def imbalance_ratio(load: torch.Tensor) -> torch.Tensor:
    """max / mean over the last dimension (1.0 = perfectly balanced); 0 where nothing ran.

    Args:
        load: [..., N] tokens per expert (or per rank).
    """
    load = load.double()
    mean = load.mean(dim=-1)
    return torch.where(mean > 0, load.amax(dim=-1) / mean.clamp_min(1e-12), 0.0)


def balancedness(load: torch.Tensor) -> torch.Tensor:
    """mean / max over the last dimension (1.0 = perfectly balanced); 0 where nothing ran."""
    load = load.double()
    peak = load.amax(dim=-1)
    return torch.where(peak > 0, load.mean(dim=-1) / peak.clamp_min(1e-12), 0.0)
