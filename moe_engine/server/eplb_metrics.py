"""Runtime EPLB's Prometheus series (`moe_engine_eplb_*`), refreshed from GetServerStats'
`EplbStats` by `ServerMetrics.update_from_stats` (present only with --enable-eplb).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from moe_engine.core.eplb_stats import EplbStats


class EplbMetrics:
    """The moe_engine_eplb_* collectors in `registry`; `update` moves them to the engine's
    totals (counters only count increments, as `ServerMetrics._advance` does)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.rebalances = Counter(
            "moe_engine_eplb_rebalances", "Expert rebalances committed (--enable-eplb).",
            registry=r)
        self.decisions = Counter(
            "moe_engine_eplb_decisions",
            "Rebalancing decisions taken (one per --eplb-step-interval steps), moving or not: "
            "a controller that stopped deciding shows here.", registry=r)
        self.experts_moved = Counter(
            "moe_engine_eplb_experts_moved",
            "(MoE layer, slot) entries whose expert a rebalance changed, summed over ranks.",
            registry=r)
        self.bytes_moved = Counter(
            "moe_engine_eplb_bytes_moved",
            "Expert-weight bytes rebalances sent between ranks (bytes), summed over ranks.",
            registry=r)
        self.seconds = Counter(
            "moe_engine_eplb_seconds",
            'Seconds rebalances spent moving weights (phase="transfer", spread over steps) and '
            'swapping them in (phase="commit"), the slowest rank\'s.',
            ["phase"], registry=r)
        self.balancedness = Gauge(
            "moe_engine_eplb_balancedness",
            "Rank balancedness (mean / max token-expert pairs per rank, averaged over MoE "
            'layers; 1 = even): measured over the last decision\'s window (when="window"), '
            'and of the last rebalance: predicted before and after it (when="before", '
            '"after_predicted") and measured over the window after it ("after_measured").',
            ["when"], registry=r)
        self.last_rebalance_step = Gauge(
            "moe_engine_eplb_last_rebalance_step",
            "The engine step whose decision started the last rebalance (-1 before one).",
            registry=r)
        self.moving = Gauge(
            "moe_engine_eplb_moving", "1 while a rebalance's weights are in transit.",
            registry=r)
        self._last: dict[str, float] = {}

    def _advance(self, key: str, counter: Counter, value: float) -> None:
        delta = value - self._last.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._last[key] = value

    def update(self, stats: EplbStats) -> None:
        """Refresh every series from the engine's EPLB stats."""
        self._advance("rebalances", self.rebalances, stats.num_rebalances)
        self._advance("decisions", self.decisions, stats.num_decisions)
        self._advance("experts", self.experts_moved, stats.experts_moved)
        self._advance("bytes", self.bytes_moved, stats.bytes_sent)
        self._advance("transfer", self.seconds.labels(phase="transfer"), stats.transfer_s)
        self._advance("commit", self.seconds.labels(phase="commit"), stats.commit_s)
        self.balancedness.labels(when="window").set(stats.balancedness)
        if stats.rebalances:
            last = stats.rebalances[-1]
            self.balancedness.labels(when="before").set(last.balancedness_before)
            self.balancedness.labels(when="after_predicted").set(
                last.balancedness_after_predicted)
            self.balancedness.labels(when="after_measured").set(
                last.balancedness_after_measured)
        self.last_rebalance_step.set(stats.last_rebalance_step)
        self.moving.set(1 if stats.moving else 0)
