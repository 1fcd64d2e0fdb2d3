"""Prometheus metrics of the serving path (Ingress replica), exposed at `GET /metrics`.

Each ingress replica owns one `CollectorRegistry`; the counters are fed from the `DoneEvent`
every generation ends with, and the replica gauge is read from `serve.status()` at scrape time.
(With several ingress replicas each exposes its own counts; in a KubeRay cluster Ray's own
metrics export aggregates the `ray_serve_*` series across replicas.)
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mpic.deployments.messages import DoneEvent

logger = logging.getLogger(__name__)

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServeMetrics:
    """The MPIC series: TTFT, output tokens/s, cache hits per tier, fallbacks, replicas."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "mpic_ttft_seconds",
            "Time to first token seen by the ingress.",
            ["policy"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tokens_per_s = Histogram(
            "mpic_output_tokens_per_second",
            "Decode speed per request.",
            ["policy"],
            buckets=(1, 5, 10, 25, 50, 100, 250, 500, 1000),
            registry=r,
        )
        self.requests = Counter(
            "mpic_requests", "Chat requests by outcome.", ["policy", "outcome"], registry=r
        )
        self.prompt_tokens = Counter("mpic_prompt_tokens", "Prompt tokens.", registry=r)
        self.cached_tokens = Counter("mpic_cached_tokens", "Linked (reused) tokens.", registry=r)
        self.output_tokens = Counter("mpic_output_tokens", "Generated tokens.", registry=r)
        self.cache_hits = Counter(
            "mpic_cache_hits", "Cache entries served, by storage tier.", ["tier"], registry=r
        )
        self.fallbacks = Counter(
            "mpic_fallbacks", "Entries missing or corrupt and recomputed instead.", registry=r
        )
        self.uploads = Counter("mpic_uploads", "Files uploaded and cached.", registry=r)
        self.replicas = Gauge(
            "mpic_replicas", "Running replicas per deployment.", ["deployment"], registry=r
        )

    def record(self, policy: str, done: DoneEvent, ttft_s: float, decode_s: float) -> None:
        """Record one finished generation."""
        self.requests.labels(policy, "ok").inc()
        self.ttft.labels(policy).observe(ttft_s)
        if done.completion_tokens > 1 and decode_s > 0:
            self.tokens_per_s.labels(policy).observe((done.completion_tokens - 1) / decode_s)
        self.prompt_tokens.inc(done.prompt_tokens)
        self.cached_tokens.inc(done.cached_tokens)
        self.output_tokens.inc(done.completion_tokens)
        for tier, n in done.tier_hits.items():
            self.cache_hits.labels(tier).inc(n)
        self.fallbacks.inc(done.fallbacks)

    def render(self, app_name: str) -> bytes:
        """The exposition text; refreshes the replica gauge from the Serve controller."""
        try:
            from ray import serve

            app = serve.status().applications.get(app_name)
            for name, dep in app.deployments.items() if app else []:
                running = dep.replica_states.get("RUNNING", 0)
                self.replicas.labels(name).set(running)
        except Exception:  # the controller may be briefly unreachable; metrics must still serve
            logger.warning("could not read serve.status() for the replica gauge", exc_info=True)
        return generate_latest(self.registry)
