"""The engine's Prometheus metrics (``GET /metrics``), in a registry of their own per engine."""

from __future__ import annotations

import prometheus_client as prom

# Seconds: from a few milliseconds (a warm decode step) to minutes (a long queue on a CPU).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    def __init__(self):
        self.registry = r = prom.CollectorRegistry()
        self.waiting = prom.Gauge("maxlm_requests_waiting", "Requests queued, not yet admitted", registry=r)
        self.running = prom.Gauge("maxlm_requests_running", "Requests prefilling or decoding", registry=r)
        self.blocks_used = prom.Gauge("maxlm_kv_blocks_used", "KV blocks held by requests or the prefix cache "
                                      "and not reusable", registry=r)
        self.blocks_free = prom.Gauge("maxlm_kv_blocks_free", "KV blocks on the free list", registry=r)
        self.kv_waste = prom.Gauge("maxlm_kv_waste_ratio", "Share of allocated KV slots holding no token, "
                                   "averaged over engine steps", registry=r)
        self.prefix_hit_rate = prom.Gauge("maxlm_prefix_cache_hit_rate", "Prompt tokens found in the prefix "
                                          "cache / prompt tokens looked up", registry=r)
        self.tokens_per_s = prom.Gauge("maxlm_generation_tokens_per_second", "Output tokens per second over "
                                       "the last 10 s", registry=r)
        self.prompt_tokens = prom.Counter("maxlm_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = prom.Counter("maxlm_generation_tokens", "Output tokens generated", registry=r)
        self.preemptions = prom.Counter("maxlm_preemptions", "Requests preempted for lack of KV blocks",
                                        registry=r)
        self.finished = prom.Counter("maxlm_requests_finished", "Requests finished, by reason",
                                     ["reason"], registry=r)
        self.ttft = prom.Histogram("maxlm_time_to_first_token_seconds", "Arrival to first token",
                                   buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = prom.Histogram("maxlm_time_per_output_token_seconds", "Mean time between a request's "
                                   "output tokens after the first", buckets=LATENCY_BUCKETS, registry=r)

    def render(self) -> bytes:
        return prom.generate_latest(self.registry)
