"""Prometheus metrics of the serving front end, exposed on `--metrics-port` with `GET /health`,
and on the HTTP API's port as `GET /metrics` (one registry, the same text).

Gauges and counters that the core owns (running/waiting requests, KV usage, token, preemption,
rejection and abort totals) are refreshed from `EngineClient.get_stats()` by a poll task;
per-request latencies (TTFT, TPOT, end to end) are observed by the servicer as it streams
outputs, and refused API keys are counted by the interceptor.
Names follow vLLM's metrics with the prefix `moe_engine_`; vLLM's own `vllm:*` series sit beside
them (`vllm_metrics.VllmMetrics`). `StatsLogger` writes vLLM's periodic
log line (requests, KV usage, throughput) while the engine is busy.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import torch
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    make_wsgi_app,
)
from prometheus_client.exposition import ThreadingWSGIServer

from moe_engine.core.outputs import CoreStats, EngineStats, ExpertLoad
from moe_engine.instrumentation import balancedness, imbalance_ratio
from moe_engine.server.eplb_metrics import EplbMetrics
from moe_engine.server.request_timer import RequestTimer
from moe_engine.server.vllm_metrics import VllmMetrics

logger = logging.getLogger(__name__)

#: The path of the HTTP health check on the metrics port.
HEALTH_PATH = "/health"
#: What the health check asks: (serving, one line of detail).
HealthFn = Callable[[], tuple[bool, str]]

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
        self.spec_drafts = Counter(
            "moe_engine_spec_decode_num_drafts",
            "Request-steps that verified draft tokens (speculative decoding).",
            registry=r,
        )
        self.spec_draft_tokens = Counter(
            "moe_engine_spec_decode_num_draft_tokens", "Draft tokens verified (tokens).",
            registry=r,
        )
        self.spec_accepted_tokens = Counter(
            "moe_engine_spec_decode_num_accepted_tokens", "Draft tokens accepted (tokens).",
            registry=r,
        )
        self.spec_accepted_per_pos = Counter(
            "moe_engine_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0 = a step's first draft).",
            ["position"],
            registry=r,
        )
        self.eplb = EplbMetrics(r)
        self._last_totals: dict[int | tuple[int, int], int] = {}
        #: vLLM's series, once the served model is known (`enable_vllm`).
        self.vllm: VllmMetrics | None = None

    def enable_vllm(self, model_name: str, max_model_len: int) -> None:
        """Add vLLM's `vllm:*` series (`vllm_metrics`) for the served model (once; its
        token-count buckets need `max_model_len`, known when the engine is up)."""
        if self.vllm is None:
            self.vllm = VllmMetrics(self.registry, model_name, max_model_len)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of every series, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def update_from_stats(self, stats: EngineStats) -> None:
        """Refresh gauges and counters from the engine's stats (totals over its ranks)."""
        t = stats.total
        if self.vllm is not None:
            self.vllm.update_from_stats(t)
        self.requests_running.set(t.num_running)
        self.requests_waiting.set(t.num_waiting)
        self.kv_cache_usage.set(t.kv_cache_usage)
        totals = (
            (self.prompt_tokens, t.prompt_tokens_total),
            (self.generation_tokens, t.generation_tokens_total),
            (self.preemptions, t.num_preemptions),
            (self.requests_rejected, t.num_rejected),
            (self.requests_aborted, t.num_aborted),
            (self.prefix_cache_queries, t.prefix_cache_queries),
            (self.prefix_cache_hits, t.prefix_cache_hits),
            (self.spec_drafts, t.spec_decode_num_drafts),
            (self.spec_draft_tokens, t.spec_decode_num_draft_tokens),
            (self.spec_accepted_tokens, t.spec_decode_num_accepted_tokens),
        )
        for counter, value in totals:
            self._advance(counter, id(counter), value)
        for pos, value in enumerate(t.spec_decode_num_accepted_tokens_per_pos):
            counter = self.spec_accepted_per_pos.labels(position=str(pos))
            self._advance(counter, (id(self.spec_accepted_per_pos), pos), value)
        for group in t.kv_groups:
            labels = dict(group=str(group.group), kind=group.kind)
            self.kv_group_blocks_used.labels(**labels).set(group.blocks_used)
        if t.eplb is not None:
            self.eplb.update(t.eplb)

    def _advance(self, counter: Any, key: int | tuple[int, int], value: int) -> None:
        """Move a counter up to the engine's total `value` (it only counts increments)."""
        delta = value - self._last_totals.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._last_totals[key] = value

    def update_from_expert_load(self, load: ExpertLoad) -> None:
        """Refresh the per-layer skew gauges from the engine's expert load.

        Uses `window_counts` ([L][E], the recent window), else `counts` (since startup), for
        by="expert"; `rank_tokens` ([L][N], token-expert pairs
        per rank) for by="rank" when present. Layers are labelled by decoder-layer index.
        """
        sources = {"expert": load.window_counts or load.counts}
        if load.rank_tokens:
            sources["rank"] = load.rank_tokens
        for by, table in sources.items():
            if not table or not load.moe_layers:
                continue
            values = torch.tensor(table, dtype=torch.float64)
            ratios, balanced = imbalance_ratio(values).tolist(), balancedness(values).tolist()
            for layer, ratio, bal in zip(load.moe_layers, ratios, balanced, strict=True):
                self.imbalance_ratio.labels(layer=str(layer), by=by).set(ratio)
                self.balancedness.labels(layer=str(layer), by=by).set(bal)

    def observe_finished(self, timer: RequestTimer, finish_reason: str) -> None:
        """Record one finished request's latencies."""
        self.requests_finished.labels(finish_reason=finish_reason or "unknown").inc()
        if self.vllm is not None:
            self.vllm.observe_finished(timer, finish_reason)
        if timer.first_token_s is None:
            return
        end = timer.last_output_s
        self.ttft.observe(timer.first_token_s - timer.arrival_s)
        self.e2e.observe(end - timer.arrival_s)
        if timer.num_output_tokens > 1:
            self.tpot.observe((end - timer.first_token_s) / (timer.num_output_tokens - 1))

    def start_http(self, port: int, host: str = "127.0.0.1", health: HealthFn | None = None) -> Any:
        """Serve /metrics (and `GET /health` when `health` is given) on host:port from a
        background thread; returns the HTTP server (`shutdown()`, `server_close()`).

        `/health` answers 200 while `health()` says serving and 503 otherwise, with a JSON body
        {"status": "SERVING" | "NOT_SERVING", "detail": ...}.

        Raises:
            OSError: the port cannot be bound.
        """
        metrics_app = make_wsgi_app(self.registry)

        def app(environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
            if health is None or environ.get("PATH_INFO") != HEALTH_PATH:
                return metrics_app(environ, start_response)
            serving, detail = health()
            body = json.dumps(
                {"status": "SERVING" if serving else "NOT_SERVING", "detail": detail}
            ).encode()
            status = "200 OK" if serving else "503 Service Unavailable"
            start_response(status, [("Content-Type", "application/json"),
                                    ("Content-Length", str(len(body)))])
            return [body]

        class Server(ThreadingWSGIServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        server = make_server(host, port, app, Server, handler_class=_QuietHandler)
        threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
        return server


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape or probe."""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass


class StatsLogger:
    """The periodic log line vLLM writes while busy, from the engine's stats:

        running: 2 reqs, waiting: 0 reqs, KV cache usage: 3.1%, prompt throughput:
        12.0 tokens/s, generation throughput: 40.2 tokens/s

    Throughputs are over the interval since the previous `observe`; a line is logged only
    when the interval saw tokens or requests are running or waiting (an idle server is quiet).

    Args:
        log: where the line goes (INFO).
    """

    def __init__(self, log: logging.Logger = logger) -> None:
        self.log = log
        self._last: tuple[float, CoreStats] | None = None

    def observe(self, stats: EngineStats, now: float) -> str | None:
        """Take one stats sample at `now` (seconds, any monotonic clock); the line logged, or
        None (the first sample, or no activity)."""
        t, last = stats.total, self._last
        self._last = (now, t)
        if last is None or now <= last[0]:
            return None
        elapsed, before = now - last[0], last[1]
        prompt = t.prompt_tokens_total - before.prompt_tokens_total
        generated = t.generation_tokens_total - before.generation_tokens_total
        if not (prompt > 0 or generated > 0 or t.num_running or t.num_waiting):
            return None
        line = (
            f"running: {t.num_running} reqs, waiting: {t.num_waiting} reqs, KV cache usage: "
            f"{100 * t.kv_cache_usage:.1f}%, prompt throughput: {prompt / elapsed:.1f} tokens/s, "
            f"generation throughput: {generated / elapsed:.1f} tokens/s"
        )
        queries = t.prefix_cache_queries - before.prefix_cache_queries
        if queries > 0:
            hits = t.prefix_cache_hits - before.prefix_cache_hits
            line += f", prefix cache hit rate: {100 * hits / queries:.1f}%"
        line += _spec_decode_part(t, before)
        self.log.info("%s", line)
        return line


def _spec_decode_part(t: CoreStats, before: CoreStats) -> str:
    """The speculative-decoding part of the periodic line over the interval (vLLM's "SpecDecoding
    metrics"): mean acceptance length, drafts accepted, per-position acceptance rate; "" when
    the interval verified no drafts."""
    drafts = t.spec_decode_num_drafts - before.spec_decode_num_drafts
    if drafts <= 0:
        return ""
    proposed = t.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = t.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    old = before.spec_decode_num_accepted_tokens_per_pos
    per_pos = [
        (v - (old[i] if i < len(old) else 0)) / drafts
        for i, v in enumerate(t.spec_decode_num_accepted_tokens_per_pos)
    ]
    rates = ", ".join(f"{r:.2f}" for r in per_pos)
    return (
        f", spec decode: mean acceptance length {1 + accepted / drafts:.2f}, accepted "
        f"{accepted}/{proposed} draft tokens ({100 * accepted / max(proposed, 1):.1f}%), "
        f"per-position acceptance rate [{rates}]"
    )
