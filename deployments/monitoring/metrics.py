"""Metrics of the serving path through Ray Serve's metrics API (Ingress and LLM-worker replicas),
and the `GET /metrics` view of them.

Every series is a `ray.serve.metrics` Counter/Histogram: Serve tags it with the deployment,
replica and application, and Ray's metrics agent on each node exports every replica's series
(Prometheus scrapes the agents, `http://<node>:<metrics_export_port>/metrics`, as KubeRay's
PodMonitor does). So with several ingress or worker replicas nothing is lost: a scrape, or the
ingress's `/metrics` route, which gathers the `mpic_*` series of every node's agent, sees the
requests of all of them (sum over the `replica` tag). Outside a Ray cluster (the in-process test
harness) recording is a no-op.

Series (all prefixed `mpic_`; Ray appends `_total` to counters in the exposition):
  requests{route, outcome}        every HTTP request: outcome = ok | <status> | stream_error
  ttft_seconds{policy}            time to first token seen by the ingress
  inter_token_seconds{policy}     mean gap between streamed tokens of one answer
  prompt_tokens, cached_tokens, output_tokens, uploads, fallbacks
  store_hits{tier}, store_misses{tier}, store_read_bytes{tier}, store_written_bytes{tier}
                                  the LLM worker's entry-store tiers (memory / disk / object)
  recomputed_tokens, tier_hits{tier}
                                  prompt tokens computed (not linked); entries per tier
  flex_eager_falls, flex_graphs   the LLM worker process's compiled functions (FlexAttention,
                                  the layer step): calls run eagerly after dynamo's recompile
                                  limit (should stay 0), and the graphs dynamo holds
                                  (`mpic.kernels.compiled.compile_stats`; the reference
                                  engine's, whose layers run in that process)
The same requests are also recorded under vLLM's names (`vllm:time_to_first_token_seconds`,
...; `mpic.deployments.monitoring.vllm_metrics`), shown by `/metrics` summed over replicas.
"""

from __future__ import annotations

import logging

from ray.serve.metrics import Counter, Gauge, Histogram

from mpic.deployments.messages import DoneEvent
from mpic.deployments.monitoring.vllm_metrics import VllmRequestMetrics, render_vllm_metrics

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
_ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]
_STORE_SERIES = {
    "mpic_store_hits": "store_hits",
    "mpic_store_misses": "store_misses",
    "mpic_store_read_bytes": "store_read_bytes",
    "mpic_store_written_bytes": "store_written_bytes",
}


def policy_label(policy: str) -> str:
    """The bounded metrics label of a policy name: its family (`mpic-32` -> `mpic`,
    `vlcache-0.1:0.2` -> `vlcache`), or "other" for anything not a known family, so no request
    can create a time series of its own."""
    from mpic.linker.policies import POLICY_NAMES

    families = {n.split("-<", 1)[0] for n in POLICY_NAMES}
    if policy in families:
        return policy
    head = policy.rsplit("-", 1)[0] if "-" in policy else policy
    return head if head in families and "<" not in head else "other"


class ServeMetrics:
    """The ingress series (one object per replica process; Ray aggregates across replicas)."""

    def __init__(self) -> None:
        self.requests = Counter(
            "mpic_requests",
            description="HTTP requests by route template and outcome (ok, status, stream_error).",
            tag_keys=("route", "outcome"),
        )
        self.ttft = Histogram(
            "mpic_ttft_seconds",
            description="Time to first token seen by the ingress.",
            boundaries=_LATENCY_BUCKETS,
            tag_keys=("policy",),
        )
        self.inter_token = Histogram(
            "mpic_inter_token_seconds",
            description="Mean time between generated tokens of one answer.",
            boundaries=_ITL_BUCKETS,
            tag_keys=("policy",),
        )
        self.prompt_tokens = Counter("mpic_prompt_tokens", description="Prompt tokens.")
        self.cached_tokens = Counter(
            "mpic_cached_tokens", description="Prompt tokens served from cached entries."
        )
        self.output_tokens = Counter("mpic_output_tokens", description="Generated tokens.")
        self.fallbacks = Counter(
            "mpic_fallbacks", description="Entries lost or corrupt and recomputed instead."
        )
        self.uploads = Counter("mpic_uploads", description="Files uploaded and cached.")
        self.recomputed_tokens = Counter(
            "mpic_recomputed_tokens",
            description="Prompt tokens computed per request (prompt minus cached/linked ones).",
        )
        self.tier_hits = Counter(
            "mpic_tier_hits",
            description="Linked entries served per storage tier (memory, disk, object).",
            tag_keys=("tier",),
        )
        self.vllm = VllmRequestMetrics()
        """The same requests under vLLM's metric names
        (`mpic.deployments.monitoring.vllm_metrics`)."""
        self.model_name = "mpic"
        """`model_name` label of the vLLM-named series (the ingress sets the served name)."""

    def request(self, route: str, outcome: str) -> None:
        """Count one HTTP request."""
        self.requests.inc(1, tags={"route": route, "outcome": outcome})

    def record(self, policy: str, done: DoneEvent, ttft_s: float, decode_s: float) -> None:
        """Record one finished generation (`decode_s`: first token to last). The policy label
        is its family (`policy_label`): bounded, whatever the request named."""
        policy = policy_label(policy)
        self.ttft.observe(ttft_s, tags={"policy": policy})
        if done.completion_tokens > 1 and decode_s > 0:
            self.inter_token.observe(
                decode_s / (done.completion_tokens - 1), tags={"policy": policy}
            )
        for counter, n in (
            (self.prompt_tokens, done.prompt_tokens),
            (self.cached_tokens, done.cached_tokens),
            (self.output_tokens, done.completion_tokens),
            (self.fallbacks, done.fallbacks),
            (self.recomputed_tokens, max(done.prompt_tokens - done.cached_tokens, 0)),
        ):
            if n:
                counter.inc(n)
        for tier, hits in (done.tier_hits or {}).items():
            if hits:
                self.tier_hits.inc(hits, tags={"tier": tier})
        self.vllm.record(self.model_name, done, ttft_s, decode_s)


class StoreMetricsExporter:
    """Mirrors an `EntryStore`'s per-tier counters (a process-local prometheus_client registry,
    the storage layer knows no Ray) into Ray Serve counters: `export()` adds what grew since
    the last call. Runs in the LLM worker after each upload and generation."""

    def __init__(self, store_metrics) -> None:
        self.source = store_metrics
        self.counters = {
            name: Counter(
                f"mpic_{short}", description=f"Entry store: {short} by tier.", tag_keys=("tier",)
            )
            for name, short in _STORE_SERIES.items()
        }
        self.seen: dict[tuple[str, str], float] = {}

    def export(self) -> None:
        """Add the growth of every tier counter since the last export."""
        for family in self.source.registry.collect():
            counter = self.counters.get(family.name)
            if counter is None:
                continue
            for sample in family.samples:
                if not sample.name.endswith("_total"):
                    continue
                tier = sample.labels.get("tier", "")
                key = (family.name, tier)
                delta = sample.value - self.seen.get(key, 0.0)
                if delta > 0:
                    counter.inc(delta, tags={"tier": tier})
                    self.seen[key] = sample.value


class CompileMetricsExporter:
    """Mirrors this process's compiled-function figures (`mpic.kernels.compiled.compile_stats`)
    into Ray Serve series: `mpic_flex_eager_falls` grows by the calls that ran eagerly since the
    last `export()` (a fall is also logged once, with its reason), `mpic_flex_graphs` is the
    graphs dynamo holds. Runs in the LLM worker after each generation."""

    def __init__(self) -> None:
        self.falls = Counter(
            "mpic_flex_eager_falls",
            description="Compiled calls (FlexAttention, layer step) run eagerly after dynamo's "
            "recompile limit.",
        )
        self.graphs = Gauge(
            "mpic_flex_graphs", description="Graphs of the compiled FlexAttention and layer step."
        )
        self.seen_falls = 0

    def export(self) -> None:
        """Add the falls since the last call; set the graph count."""
        from mpic.kernels.compiled import compile_stats

        stats = compile_stats()
        if stats["eager_falls"] > self.seen_falls:
            self.falls.inc(stats["eager_falls"] - self.seen_falls)
            self.seen_falls = stats["eager_falls"]
        if stats["graphs"] is not None:
            self.graphs.set(stats["graphs"])


def gather_cluster_metrics(prefixes: tuple[str, ...] = ("mpic_", "ray_mpic_", "vllm")) -> str:
    """The Prometheus text of every alive node's Ray metrics agent, only the series whose name
    starts with one of `prefixes` (plus their HELP/TYPE lines). Empty outside a Ray cluster."""
    import httpx
    import ray

    if not ray.is_initialized():
        return "# no Ray cluster: metrics are recorded only under Ray Serve\n"
    out: list[str] = []
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if not node.get("Alive") or not port:
            continue
        url = f"http://{node['NodeManagerAddress']}:{port}/metrics"
        try:
            text = httpx.get(url, timeout=5).text
        except httpx.HTTPError as exc:
            logger.warning("metrics agent %s did not answer: %s", url, exc)
            continue
        for line in text.splitlines():
            name = line.split(" ", 3)[2] if line.startswith("# ") else line
            if name.startswith(prefixes):
                out.append(line)
    return "\n".join(out) + "\n"


def metrics_page(model: str) -> str:
    """`GET /metrics`: the `mpic_*` series of every replica as Ray's agents export them, then
    the vLLM-named series summed over replicas (`render_vllm_metrics`; `model`: the served
    name for the derived gauges)."""
    text = gather_cluster_metrics(("mpic_", "ray_mpic_", "ray_vllm_"))
    own = "\n".join(line for line in text.splitlines() if "ray_vllm_" not in line)
    return own.rstrip("\n") + "\n" + render_vllm_metrics(text, model)
