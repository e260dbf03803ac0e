"""Prometheus metrics of the serving front end, exposed on `--metrics-port`.

Gauges and counters that the core owns (running/waiting requests, KV usage, token, preemption,
rejection and abort totals) are refreshed from `EngineClient.get_stats()` by a poll task;
per-request latencies (TTFT, TPOT, end to end) are observed by the servicer as it streams
outputs, and refused API keys are counted by the interceptor.
Names follow vLLM's metrics with the prefix `moe_engine_`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from moe_engine.instrumentation import balancedness, imbalance_ratio
from moe_engine.request import RequestOutput

_LATENCY_BUCKETS_S = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TPOT_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
#: Core counters mirrored as Prometheus counters: stats key -> attribute name.
_COUNTED = {
    "prompt_tokens_total": "prompt_tokens",
    "generation_tokens_total": "generation_tokens",
    "num_preemptions": "preemptions",
    "num_rejected": "requests_rejected",
    "num_aborted": "requests_aborted",
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
}


class ServerMetrics:
    """The server's collectors, in their own registry (several servers may share a process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests_running = Gauge(
            "moe_engine_num_requests_running", "Requests in the running batch.", registry=r
        )
        self.requests_waiting = Gauge(
            "moe_engine_num_requests_waiting", "Requests waiting to be scheduled.", registry=r
        )
        self.kv_cache_usage = Gauge(
            "moe_engine_kv_cache_usage_ratio", "Used KV blocks / all KV blocks (0..1).", registry=r
        )
        self.ttft = Histogram(
            "moe_engine_time_to_first_token_seconds",
            "Arrival to first generated token (seconds).",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.tpot = Histogram(
            "moe_engine_time_per_output_token_seconds",
            "Mean time between generated tokens after the first (seconds).",
            buckets=_TPOT_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "moe_engine_e2e_request_latency_seconds",
            "Arrival to last output (seconds).",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "moe_engine_prompt_tokens", "Prompt tokens admitted (tokens).", registry=r
        )
        self.generation_tokens = Counter(
            "moe_engine_generation_tokens", "Tokens generated (tokens).", registry=r
        )
        self.preemptions = Counter(
            "moe_engine_num_preemptions", "Requests preempted (recompute).", registry=r
        )
        self.requests_rejected = Counter(
            "moe_engine_num_requests_rejected",
            "Requests refused because the waiting queue was full (RESOURCE_EXHAUSTED).",
            registry=r,
        )
        self.requests_aborted = Counter(
            "moe_engine_num_requests_aborted",
            "Requests aborted (client cancel or deadline, Abort, drain timeout).",
            registry=r,
        )
        self.auth_failures = Counter(
            "moe_engine_num_unauthenticated",
            "Calls refused with UNAUTHENTICATED (missing or wrong API key).",
            registry=r,
        )
        self.prefix_cache_queries = Counter(
            "moe_engine_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (tokens; --enable-prefix-caching).",
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "moe_engine_prefix_cache_hits",
            "Prompt tokens found in the prefix cache and not recomputed (tokens).",
            registry=r,
        )
        self.kv_group_blocks_used = Gauge(
            "moe_engine_kv_cache_group_blocks_used",
            "KV blocks held by live requests in one KV-cache group.",
            ["group", "kind"],
            registry=r,
        )
        self.requests_finished = Counter(
            "moe_engine_requests_finished",
            "Finished requests by finish reason.",
            ["finish_reason"],
            registry=r,
        )
        self.imbalance_ratio = Gauge(
            "moe_engine_imbalance_ratio",
            "Routing load max / mean of one MoE layer (1 = balanced), over its experts "
            '(by="expert") or over the EP ranks (by="rank").',
            ["layer", "by"],
            registry=r,
        )
        self.balancedness = Gauge(
            "moe_engine_balancedness",
            "Routing load mean / max of one MoE layer (1 = balanced), by expert or by rank.",
            ["layer", "by"],
            registry=r,
        )
        self._last_totals: dict[str, int] = {}

    def update_from_stats(self, stats: dict[str, Any]) -> None:
        """Refresh gauges and counters from `EngineCore.get_stats()`."""
        self.requests_running.set(stats.get("num_running", 0))
        self.requests_waiting.set(stats.get("num_waiting", 0))
        total = stats.get("kv_blocks_total", 0)
        self.kv_cache_usage.set(stats.get("kv_blocks_used", 0) / total if total else 0.0)
        for key, attr in _COUNTED.items():
            value = int(stats.get(key, 0))
            delta = value - self._last_totals.get(key, 0)
            if delta > 0:
                getattr(self, attr).inc(delta)
            self._last_totals[key] = value
        for group in stats.get("kv_groups") or []:
            labels = dict(group=str(group["group"]), kind=str(group["kind"]))
            self.kv_group_blocks_used.labels(**labels).set(group["blocks_used"])

    def update_from_expert_load(self, load: dict[str, Any]) -> None:
        """Refresh the per-layer skew gauges from `EngineCore.get_expert_load()`'s dict.

        Uses `window_counts` ([L][E], the recent window) when present, else `counts` (since
        startup), for by="expert"; `rank_tokens` ([L][N], token-expert pairs per rank) for
        by="rank" when present. Layers are labelled by decoder-layer index (`moe_layers`).
        """
        layers = load.get("moe_layers") or []
        sources = {"expert": load.get("window_counts") or load.get("counts")}
        if load.get("rank_tokens"):
            sources["rank"] = load["rank_tokens"]
        for by, table in sources.items():
            if not table or not layers:
                continue
            values = torch.tensor(table, dtype=torch.float64)
            ratios, balanced = imbalance_ratio(values).tolist(), balancedness(values).tolist()
            for layer, ratio, bal in zip(layers, ratios, balanced, strict=True):
                self.imbalance_ratio.labels(layer=str(layer), by=by).set(ratio)
                self.balancedness.labels(layer=str(layer), by=by).set(bal)

    def observe_finished(self, timer: RequestTimer, finish_reason: str) -> None:
        """Record one finished request's latencies."""
        self.requests_finished.labels(finish_reason=finish_reason or "unknown").inc()
        if timer.first_token_s is None:
            return
        end = timer.last_output_s
        self.ttft.observe(timer.first_token_s - timer.arrival_s)
        self.e2e.observe(end - timer.arrival_s)
        if timer.num_output_tokens > 1:
            self.tpot.observe((end - timer.first_token_s) / (timer.num_output_tokens - 1))

    def start_http(self, port: int, host: str = "127.0.0.1") -> Any:
        """Serve /metrics on host:port in a background thread; returns the HTTP server."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server


@dataclass
class RequestTimer:
    """Wall-clock times of one request (time.monotonic() seconds)."""

    arrival_s: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None
    last_output_s: float = 0.0
    num_output_tokens: int = 0

    def record(self, out: RequestOutput) -> None:
        """Note an output: the first one with tokens fixes the time to first token."""
        now = time.monotonic()
        if out.new_token_ids and self.first_token_s is None:
            self.first_token_s = now
        self.last_output_s = now
        self.num_output_tokens = out.num_output_tokens
