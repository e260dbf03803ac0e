"""Per-group routing load for models whose experts come in groups (group-limited routing).

DeepSeek-V2's device-limited and DeepSeek-V3's node-limited routing (arXiv:2405.04434 sec.
2.1.3, arXiv:2412.19437 sec. 2.1.2) split the E routed experts into `n_group` groups of
contiguous ids (group g holds experts [g * E / n_group, (g + 1) * E / n_group)) and let each
token use at most `topk_group` of them; DeepSeek-V3 places one group per node. How the load
falls on the groups is then the load a node (or device) sees.

Per MoE layer this reports, from the per-expert token-expert pair counts:
- pairs per group: the sum of the group's experts' pairs (a token that chose two experts of a
  group counts twice; distinct tokens per group are not recorded);
- the hottest group and its share of the layer's pairs;
- `imbalance_ratio` = max / mean over the groups (1.0 = balanced) and `balancedness` = mean /
  max, the conventions of `moe_engine.instrumentation`.
The layout comes from the trace's meta "n_group" (written when the model has groups), or is
given (`moe-skew report --n-group N`, e.g. for a live server).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


def check_n_group(num_experts: int, n_group: int) -> None:
    """Refuse a group layout that does not split the experts evenly.

    Raises:
        ValueError: n_group < 1 or not dividing num_experts (names both).
    """
    if n_group < 1 or num_experts % n_group:
        raise ValueError(
            f"n_group ({n_group}) must be >= 1 and divide the number of experts ({num_experts})"
        )


def group_load(counts: np.ndarray, n_group: int) -> np.ndarray:
    """[..., E] token-expert pairs per expert -> [..., n_group] pairs per group (int64).

    Raises:
        ValueError: see `check_n_group`.
    """
    counts = np.asarray(counts)
    num_experts = counts.shape[-1]
    check_n_group(num_experts, n_group)
    grouped = counts.reshape(*counts.shape[:-1], n_group, num_experts // n_group)
    return grouped.sum(axis=-1, dtype=np.int64)


@dataclass
class GroupLoad:
    """One MoE layer's load by expert group.

    Attributes:
        n_group: groups of E / n_group contiguous experts.
        pairs: [n_group] token-expert pairs per group.
        hottest_group: the group with the most pairs (lower id on ties).
        hottest_share: its share of the layer's pairs (0 when the layer ran nothing).
        imbalance: max / mean over the groups (0 when nothing ran).
        balancedness: mean / max over the groups (0 when nothing ran).
    """

    n_group: int
    pairs: list[int]
    hottest_group: int
    hottest_share: float
    imbalance: float
    balancedness: float

    @classmethod
    def of(cls, expert_pairs: np.ndarray, n_group: int) -> GroupLoad:
        """From one layer's [E] pairs per expert.

        Raises:
            ValueError: see `check_n_group`.
        """
        pairs = group_load(expert_pairs, n_group)
        total, peak = int(pairs.sum()), int(pairs.max())
        mean = total / n_group
        return cls(
            n_group=n_group,
            pairs=[int(p) for p in pairs],
            hottest_group=int(np.argmax(pairs)),
            hottest_share=peak / total if total else 0.0,
            imbalance=peak / mean if total else 0.0,
            balancedness=mean / peak if total else 0.0,
        )

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def group_table(layers: list[int], loads: list[GroupLoad]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the per-group table: one row per MoE layer, one column per group
    (its pairs), then the hottest group with its share and the group max/mean and mean/max.

    Args:
        layers: the decoder-layer index of each row; loads: the matching `GroupLoad`s.
    """
    n_group = loads[0].n_group if loads else 0
    header = ["layer", *(f"g{g}" for g in range(n_group)), "hottest group (share)",
              "group max/mean", "group mean/max"]
    rows = [
        [
            str(layer),
            *(str(p) for p in load.pairs),
            f"g{load.hottest_group} ({100 * load.hottest_share:.1f}%)",
            f"{load.imbalance:.3f}",
            f"{load.balancedness:.3f}",
        ]
        for layer, load in zip(layers, loads, strict=True)
    ]
    return header, rows
