"""`moe-skew plot`: a layer x expert heat map and per-rank load bars in one PNG (matplotlib)."""

from __future__ import annotations

import os

import numpy as np

from moe_engine.skew.imbalance import max_over_mean, rank_loads
from moe_engine.skew.report import LoadData


def plot_load(data: LoadData, path: str | os.PathLike[str], title: str | None = None) -> None:
    """Write a PNG with two panels.

    Top: heat map, rows = MoE layers, columns = experts, colour = the expert's share of the
    layer's token-expert pairs (%). Bottom: for every layer, one bar per rank giving its load
    over the layer's mean rank load (1.0 = balanced; dashed line), under `data`'s placement.

    Raises:
        OSError: the file cannot be written.
        PlacementError: a placement that does not fit the counts.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    total = np.asarray(data.counts, dtype=np.float64)
    if total.ndim == 3:
        total = total.sum(axis=0)
    num_layers, num_experts = total.shape
    layer_sums = total.sum(axis=1, keepdims=True)
    share = np.divide(total, layer_sums, out=np.zeros_like(total), where=layer_sums > 0)
    ranks = rank_loads(total, data.resolved_placement(), data.moe_layers)  # [L, N]
    rank_mean = ranks.mean(axis=1, keepdims=True)
    rel = np.divide(ranks, rank_mean, out=np.zeros_like(ranks), where=rank_mean > 0)

    width = min(24.0, max(8.0, 0.18 * num_experts + 3))
    height = min(30.0, 3.5 + 0.3 * num_layers + 3.5)
    fig, (ax_heat, ax_bars) = plt.subplots(
        2, 1, figsize=(width, height), gridspec_kw=dict(height_ratios=[max(num_layers, 3), 4])
    )
    image = ax_heat.imshow(100 * share, aspect="auto", interpolation="nearest", cmap="viridis")
    ax_heat.set_xlabel("expert")
    ax_heat.set_ylabel("MoE layer (decoder index)")
    ax_heat.set_yticks(range(num_layers), [str(x) for x in data.moe_layers])
    fig.colorbar(image, ax=ax_heat, label="share of layer's token-expert pairs (%)")
    ax_heat.set_title(title or "expert load per layer")

    n = ranks.shape[1]
    bar_w = 0.8 / n
    x = np.arange(num_layers)
    for r in range(n):
        ax_bars.bar(x + (r - (n - 1) / 2) * bar_w, rel[:, r], width=bar_w, label=f"rank {r}")
    ax_bars.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax_bars.set_xticks(x, [str(v) for v in data.moe_layers])
    ax_bars.set_xlabel("MoE layer (decoder index)")
    ax_bars.set_ylabel("rank load / mean")
    imbalance = max_over_mean(ranks)
    ax_bars.set_title(
        f"per-rank load, ep_size {n} (mean max/mean over layers {imbalance.mean():.3f})"
    )
    if n <= 16:
        ax_bars.legend(ncol=min(n, 8), fontsize="small")
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=100, format="png")
    plt.close(fig)
