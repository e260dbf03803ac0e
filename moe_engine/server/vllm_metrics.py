"""vLLM's Prometheus series (`vllm:*`), beside the server's own `moe_engine_*` ones, so that
vLLM's Grafana dashboards and the routers that read `vllm:num_requests_waiting` or
`vllm:kv_cache_usage_perc` (llm-d, Dynamo) work unchanged.

Names, types, help texts, labels (`model_name`, `engine`) and buckets are vLLM v1's
(`vllm/v1/metrics/loggers.py`, `PrometheusStatLogger`; the list in vLLM's docs/design/metrics.md
and docs/usage/metrics.md): gauges `vllm:num_requests_running`, `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc` (0..1); counters `vllm:prompt_tokens`, `vllm:generation_tokens`,
`vllm:num_preemptions`, `vllm:prefix_cache_queries`, `vllm:prefix_cache_hits` (exposed with the
`_total` suffix) and `vllm:request_success` (label `finished_reason`: stop, length, abort);
histograms `vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`,
`vllm:e2e_request_latency_seconds`, `vllm:request_queue_time_seconds`,
`vllm:request_prefill_time_seconds`, `vllm:request_decode_time_seconds`,
`vllm:request_inference_time_seconds`, `vllm:request_prompt_tokens`,
`vllm:request_generation_tokens`.

Where the numbers come from: gauges and token counters from the engine's stats (the same poll
as the `moe_engine_*` ones, `MoeServer.stats_poll_s`); per-request histograms from each
finished request's `RequestTimer` (the front end's clock for TTFT, inter-token, decode and end
to end; the engine core's for queue and prefill, which the front end cannot see, as vLLM's
design note explains).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from moe_engine.core.outputs import CoreStats
from moe_engine.request import FinishReason

if TYPE_CHECKING:
    from moe_engine.server.request_timer import RequestTimer

#: vLLM's label names; `engine` is the data-parallel engine index (always "0" here).
LABELS = ("model_name", "engine")
#: vLLM's buckets (seconds), from `PrometheusStatLogger`.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                         2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                             40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class VllmMetrics:
    """The `vllm:*` collectors in `registry`, labelled with the served model's name.

    Args:
        registry: the server's registry (the same `/metrics` output as `moe_engine_*`).
        model_name: the `model_name` label (`--served-model-name`).
        max_model_len: the token-count histograms' largest bucket bound (tokens).
    """

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        self.labels = (model_name, "0")
        r, lbl = registry, LABELS

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, lbl, registry=r).labels(*self.labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, lbl, registry=r).labels(*self.labels)

        def histogram(name: str, doc: str, buckets: tuple | list) -> Histogram:
            return Histogram(name, doc, lbl, buckets=buckets, registry=r).labels(*self.labels)

        self.running = gauge("vllm:num_requests_running",
                             "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting",
                             "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc",
                              "KV-cache usage. 1 means 100 percent usage.")
        self._totals = {
            "prompt_tokens_total": counter("vllm:prompt_tokens",
                                           "Number of prefill tokens processed."),
            "generation_tokens_total": counter("vllm:generation_tokens",
                                               "Number of generation tokens processed."),
            "num_preemptions": counter("vllm:num_preemptions",
                                       "Cumulative number of preemption from the engine."),
            "prefix_cache_queries": counter(
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens."),
            "prefix_cache_hits": counter(
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens."),
        }
        self._last: dict[str, int] = {}
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*lbl, "finished_reason"], registry=r)
        self.success = {reason.value: success.labels(*self.labels, reason.value)
                        for reason in FinishReason}
        tokens = build_1_2_5_buckets(max_model_len)
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS_S)
        self.inter_token = histogram("vllm:inter_token_latency_seconds",
                                     "Histogram of inter-token latency in seconds.",
                                     INTER_TOKEN_BUCKETS_S)
        latency = REQUEST_LATENCY_BUCKETS_S
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", latency)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", latency)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.",
                                   latency)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", latency)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", latency)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens",
                                       "Number of prefill tokens processed.", tokens)
        self.generation_tokens = histogram("vllm:request_generation_tokens",
                                           "Number of generation tokens processed.", tokens)

    def update_from_stats(self, t: CoreStats) -> None:
        """Gauges from the engine's stats now; counters moved up to its totals."""
        self.running.set(t.num_running)
        self.waiting.set(t.num_waiting)
        self.kv_usage.set(t.kv_cache_usage)
        for name, counter in self._totals.items():
            value = getattr(t, name)
            delta = value - self._last.get(name, 0)
            if delta > 0:
                counter.inc(delta)
            self._last[name] = value

    def observe_finished(self, timer: RequestTimer, finish_reason: str) -> None:
        """One finished request (a `metrics.RequestTimer`) into the request-level series.

        A request answered as one final output (a non-streamed HTTP request) has no
        per-step intervals at the front end: its decode time spread evenly over its tokens
        after the first is observed once per such token, so that the inter-token histogram's
        sum and count are the same as step by step.
        """
        counter = self.success.get(finish_reason)
        if counter is not None:
            counter.inc()
        self.prompt_tokens.observe(timer.num_prompt_tokens)
        self.generation_tokens.observe(timer.num_output_tokens)
        if timer.queue_s is not None:
            self.queue.observe(timer.queue_s)
        if timer.prefill_s is not None:
            self.prefill.observe(timer.prefill_s)
        if timer.first_token_s is None:
            return
        decode_s = timer.last_output_s - timer.first_token_s
        self.ttft.observe(timer.first_token_s - timer.arrival_s)
        self.e2e.observe(timer.last_output_s - timer.arrival_s)
        self.decode.observe(decode_s)
        if timer.prefill_s is not None:
            self.inference.observe(timer.prefill_s + decode_s)
        gaps = timer.inter_token_s
        later_tokens = timer.first_completion_tokens - 1
        if not gaps and later_tokens > 0:
            gaps = [decode_s / later_tokens] * later_tokens
        for gap in gaps:
            self.inter_token.observe(gap)
