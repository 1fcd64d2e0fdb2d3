"""Prometheus metrics of the tiered entry store and the parallel fetch (the process that owns
the store: a Serve replica or vLLM worker). Each store gets its own registry (pass one in) so
tests and several stores in one process never clash."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class StoreMetrics:
    """Per-tier hits, misses, bytes read/written, resident bytes, load latency; fallbacks."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.hits = Counter(
            "mpic_store_hits", "Entry lookups served by a tier.", ["tier"], registry=r
        )
        self.misses = Counter(
            "mpic_store_misses", "Entry lookups a tier could not serve.", ["tier"], registry=r
        )
        self.bytes_read = Counter(
            "mpic_store_read_bytes", "Entry bytes loaded from a tier.", ["tier"], registry=r
        )
        self.bytes_written = Counter(
            "mpic_store_written_bytes", "Entry bytes written to a tier.", ["tier"], registry=r
        )
        self.resident = Gauge(
            "mpic_store_resident_bytes", "Bytes held by a local tier.", ["tier"], registry=r
        )
        self.latency = Histogram(
            "mpic_store_load_seconds",
            "Entry load latency per tier.",
            ["tier"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.fallbacks = Counter(
            "mpic_store_fallbacks",
            "Entries recomputed instead of loaded, by reason.",
            ["reason"],
            registry=r,
        )
        self.evictions = Counter(
            "mpic_store_evictions", "Entries evicted from a local tier.", ["tier"], registry=r
        )

    def mean_load_s(self, tier: str) -> float | None:
        """Mean entry load seconds of `tier` so far (None before its first load)."""
        count = self.registry.get_sample_value("mpic_store_load_seconds_count", {"tier": tier})
        if not count:
            return None
        total = self.registry.get_sample_value("mpic_store_load_seconds_sum", {"tier": tier})
        return float(total or 0.0) / count

    def value(self, name: str, **labels: str) -> float:
        """Current value of a sample (tests, benchmarks); 0.0 if never set."""
        v = self.registry.get_sample_value(name, labels)
        return 0.0 if v is None else v
