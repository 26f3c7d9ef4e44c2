"""Prometheus metrics for `localrun serve` (prometheus-client, one registry per server).

Request-level figures (TTFT, inter-token latency, end-to-end, queue time, token counts) are
observed by the engine thread as requests progress. Engine state (running/waiting, KV blocks,
prefix-cache counters, preemptions) comes from `engine.stats()` as the engine thread last took
it (EngineLoop.stats: after every step, so at most one step old), read at scrape time by a
custom collector; the scrape itself never touches the engine, which only its own thread may.
Stats the engine gains later (speculation, cache tiers) are exported too, as
`localrun_engine_<name>`.
"""
from __future__ import annotations

import logging

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger("localrun.server")
disable_created_metrics()      # the *_created samples only add noise to a desktop server's scrape

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0,
                   15.0, 20.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)

# engine stats with a name of their own: (stats key, metric name, kind, help)
ENGINE_METRICS = (
    ("num_running", "localrun_num_requests_running", "gauge", "Requests the engine is running."),
    ("num_waiting", "localrun_num_requests_waiting", "gauge", "Requests waiting to be admitted."),
    ("num_blocks_used", "localrun_kv_blocks_used", "gauge", "KV cache blocks in use."),
    ("num_blocks_total", "localrun_kv_blocks_total", "gauge", "KV cache blocks in the pool."),
    ("num_blocks_cached", "localrun_kv_blocks_cached", "gauge", "Free blocks that still hold a cached prefix."),
    ("kv_usage", "localrun_kv_cache_usage_ratio", "gauge", "Fraction of KV blocks in use."),
    ("prefix_cache_query_tokens", "localrun_prefix_cache_queries", "counter",
     "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hit_tokens", "localrun_prefix_cache_hits", "counter",
     "Prompt tokens found in the prefix cache."),
    ("prefix_cache_queries", "localrun_prefix_cache_lookups", "counter", "Prefix-cache lookups (requests)."),
    ("num_preemptions", "localrun_num_preemptions", "counter", "Sequences preempted to free KV blocks."),
    ("itl_target_misses", "localrun_itl_target_misses", "counter",
     "Steps with decodes that took longer than --itl-target-ms."),
    ("itl_planned_steps", "localrun_itl_planned_steps", "counter", "Steps composed to fit --itl-target-ms."),
    ("step_planned_s", "localrun_itl_step_planned_seconds", "counter",
     "Predicted time of those steps, summed (compare with localrun_itl_step_actual_seconds)."),
    ("step_actual_s", "localrun_itl_step_actual_seconds", "counter", "Measured time of those steps, summed."),
    ("num_admissions_deferred", "localrun_num_admissions_deferred", "counter",
     "Steps in which a waiting request that fit was held back to keep KV blocks in reserve."),
)


class EngineCollector:
    def __init__(self, stats: Callable[[], dict]):
        self.stats = stats

    def collect(self):
        stats = self.stats()
        named = set()
        for key, name, kind, doc in ENGINE_METRICS:
            if key not in stats:
                continue
            named.add(key)
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield family(name, doc, value=float(stats[key]))
        for key, value in stats.items():
            if key not in named and isinstance(value, (int, float)) and not isinstance(value, bool):
                yield GaugeMetricFamily(f"localrun_engine_{key}", f"engine.stats()['{key}']", value=float(value))


class ServerMetrics:
    """Also the EngineLoop's observer: it calls on_token/on_finish/on_abort."""

    def __init__(self, engine_stats: Callable[[], dict]):
        """engine_stats: the engine's stats, read without touching the engine (EngineLoop.stats)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("localrun_time_to_first_token_seconds", "Arrival to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("localrun_inter_token_latency_seconds", "Time between a request's tokens.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("localrun_e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("localrun_request_queue_time_seconds", "Arrival to first scheduled.",
                               buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("localrun_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=r)
        self.generation_tokens = Counter("localrun_generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter("localrun_requests", "Finished requests by finish reason.",
                                ["finish_reason"], registry=r)
        for reason in ("stop", "length", "abort"):
            self.requests.labels(reason)       # export zeros before the first request
        self.rejected = Counter("localrun_requests_rejected", "Requests refused with a 503 by reason "
                                "(queue_full: --max-queue requests were already waiting).", ["reason"], registry=r)
        self.rejected.labels("queue_full")
        r.register(EngineCollector(engine_stats))

    def on_token(self, gap_s: float | None) -> None:
        """A request got a token; gap_s is the time since its previous one (None for the first)."""
        self.generation_tokens.inc()
        if gap_s is not None:
            self.itl.observe(gap_s)

    def on_abort(self) -> None:
        self.requests.labels("abort").inc()

    def on_finish(self, request, seq, finish_reason: str, now: float) -> None:
        t = seq.timeline
        if t.first_token is not None:
            self.ttft.observe(t.first_token - request.arrival)
        if t.first_scheduled is not None:
            self.queue.observe(t.first_scheduled - request.arrival)
        self.e2e.observe(now - request.arrival)
        self.prompt_tokens.inc(seq.num_prompt_tokens)
        self.requests.labels(finish_reason).inc()
