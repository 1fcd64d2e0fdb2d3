"""The serving metrics under vLLM's names (Ingress and LLM-worker Serve replicas), so dashboards
and alerts built for `vllm serve` read an MPIC deployment unchanged, and their `/metrics` view
summed over every replica.

Recorded with `ray.serve.metrics` like the `mpic_*` series (`mpic.deployments.monitoring.metrics`):
each replica reports its own as `vllm_<name>` (Ray refuses ':' in a metric name), Ray's metrics
agent on each node exports them as `ray_vllm_<name>`, and `render_vllm_metrics` turns the agents'
text into vLLM's exposition: `vllm:<name>`, labels `model_name` (and `finished_reason`) only, values
summed over replicas and nodes (histogram buckets, sums and counts alike).

What each series means here (measured at the ingress, for every engine kind):
  vllm:time_to_first_token_seconds   request received -> first token sent
  vllm:e2e_request_latency_seconds   request received -> last token
  vllm:inter_token_latency_seconds   one observation per generated token after the first (the
                                     answer's mean gap, as vLLM observes each gap)
  vllm:prompt_tokens_total           prompt tokens (linked entries included)
  vllm:generation_tokens_total       generated tokens
  vllm:request_success_total         finished requests by finished_reason (stop, length)
  vllm:prefix_cache_queries_total    prompt tokens looked up = prompt tokens
  vllm:prefix_cache_hits_total       of those, tokens served from cached entries (MPIC's linked
                                     tokens: `usage.prompt_tokens_details.cached_tokens`)
  vllm:num_requests_running          generations the LLM workers have admitted (running)
  vllm:num_requests_waiting          requests the ingress accepted that no worker runs yet
                                     (resolving, queued): ingress in-flight minus running
vLLM's own engine statistics are not re-exported (their prompt and cache counts would describe
the linked requests vLLM sees, not the client's prompts).
"""

from __future__ import annotations

from collections import defaultdict

from ray.serve.metrics import Counter, Gauge, Histogram

from mpic.deployments.messages import DoneEvent

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
"""vLLM's buckets for `vllm:time_to_first_token_seconds`."""
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
"""vLLM's buckets for `vllm:e2e_request_latency_seconds`."""
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0]  # fmt: skip
"""vLLM's buckets for `vllm:inter_token_latency_seconds`."""
RAY_PREFIX = "ray_vllm_"
"""How Ray's agents export the series recorded here as `vllm_<name>` (Ray refuses ':' in metric
names); `render_vllm_metrics` shows them as vLLM's `vllm:<name>`."""
KEPT_LABELS = ("model_name", "finished_reason", "le")
"""Labels the vLLM view keeps; Ray's per-replica and per-node ones are summed away."""
IN_FLIGHT = "mpic_requests_in_flight"
"""The ingress's own gauge (accepted generations not finished) that `waiting` is derived from."""


class VllmRequestMetrics:
    """The ingress's vLLM-named series (one object per replica process)."""

    def __init__(self) -> None:
        tags = ("model_name",)
        self.ttft = Histogram(
            "vllm_time_to_first_token_seconds",
            description="Histogram of time to first token in seconds.",
            boundaries=TTFT_BUCKETS,
            tag_keys=tags,
        )
        self.e2e = Histogram(
            "vllm_e2e_request_latency_seconds",
            description="Histogram of e2e request latency in seconds.",
            boundaries=E2E_BUCKETS,
            tag_keys=tags,
        )
        self.itl = Histogram(
            "vllm_inter_token_latency_seconds",
            description="Histogram of inter-token latency in seconds.",
            boundaries=ITL_BUCKETS,
            tag_keys=tags,
        )
        self.prompt = Counter("vllm_prompt_tokens", "Number of prefill tokens processed.", tags)
        self.generation = Counter(
            "vllm_generation_tokens", "Number of generation tokens processed.", tags
        )
        self.success = Counter(
            "vllm_request_success",
            "Count of successfully processed requests.",
            ("model_name", "finished_reason"),
        )
        self.cache_queries = Counter(
            "vllm_prefix_cache_queries", "Prompt tokens queried for cached KV.", tags
        )
        self.cache_hits = Counter(
            "vllm_prefix_cache_hits", "Prompt tokens served from cached KV (MPIC links).", tags
        )
        self.in_flight = Gauge(IN_FLIGHT, "Generations this ingress accepted, not finished.")
        self.accepted = 0

    def start(self) -> None:
        """A generation request was accepted (validated, about to be resolved)."""
        self.accepted += 1
        self.in_flight.set(self.accepted)

    def end(self) -> None:
        """That request finished (answered or failed)."""
        self.accepted = max(0, self.accepted - 1)
        self.in_flight.set(self.accepted)

    def record(self, model: str, done: DoneEvent, ttft_s: float, decode_s: float) -> None:
        """One finished generation: `ttft_s` from receipt, `decode_s` first token to last."""
        tags = {"model_name": model}
        self.ttft.observe(ttft_s, tags=tags)
        self.e2e.observe(ttft_s + max(decode_s, 0.0), tags=tags)
        if done.completion_tokens > 1:
            gap = max(decode_s, 0.0) / (done.completion_tokens - 1)
            for _ in range(done.completion_tokens - 1):
                self.itl.observe(gap, tags=tags)
        for counter, n in (
            (self.prompt, done.prompt_tokens),
            (self.generation, done.completion_tokens),
            (self.cache_queries, done.prompt_tokens),
            (self.cache_hits, done.cached_tokens),
        ):
            if n:
                counter.inc(n, tags=tags)
        self.success.inc(1, tags={**tags, "finished_reason": done.finish_reason})


class RunningGauge:
    """`vllm:num_requests_running` of one LLM-worker replica (its admitted generations)."""

    def __init__(self, model: str) -> None:
        self.tags = {"model_name": model}
        self.gauge = Gauge(
            "vllm_num_requests_running",
            "Number of requests in model execution batches.",
            tag_keys=("model_name",),
        )

    def set(self, running: int) -> None:
        """Report this replica's running count."""
        self.gauge.set(running, tags=self.tags)


def _samples(text: str) -> list[tuple[str, str, dict[str, str], float, str]]:
    """(family, sample name, labels, value, type) of every `ray_vllm_` sample (named
    `vllm:<name>` as vLLM names it) and of the ingress in-flight gauge in Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for family in text_string_to_metric_families(text):
        if family.name == "ray_" + IN_FLIGHT:
            name = IN_FLIGHT
        elif family.name.startswith(RAY_PREFIX):
            name = "vllm:" + family.name.removeprefix(RAY_PREFIX)
        else:
            continue
        for s in family.samples:
            sample = name + s.name.removeprefix(family.name)
            out.append((name, sample, s.labels, s.value, family.type))
    return out


def render_vllm_metrics(text: str, model: str) -> str:
    """vLLM's exposition of the `ray_vllm:*` series in the Ray agents' `text`, summed over
    replicas (labels other than `KEPT_LABELS` dropped), plus `vllm:num_requests_waiting` =
    ingress in-flight - running (>= 0). `model` labels the derived gauges."""
    sums: dict[tuple[str, tuple[tuple[str, str], ...]], float] = defaultdict(float)
    types: dict[str, str] = {}
    in_flight = 0.0
    for family, sample, labels, value, kind in _samples(text):
        if family == IN_FLIGHT:
            in_flight += value
            continue
        types[family] = kind
        kept = tuple(sorted((k, v) for k, v in labels.items() if k in KEPT_LABELS))
        sums[(sample, kept)] += value
    running = sum(v for (s, _), v in sums.items() if s == "vllm:num_requests_running")
    if "vllm:num_requests_running" not in types:
        types["vllm:num_requests_running"] = "gauge"
        sums[("vllm:num_requests_running", (("model_name", model),))] = 0.0
    types["vllm:num_requests_waiting"] = "gauge"
    sums[("vllm:num_requests_waiting", (("model_name", model),))] = max(0.0, in_flight - running)
    lines: list[str] = []
    for family in sorted(types):
        lines.append(f"# TYPE {family} {types[family]}")
        rows = [(s, kept, v) for (s, kept), v in sums.items() if s.startswith(family)]
        rows = [r for r in rows if r[0] == family or r[0][len(family) :].startswith("_")]
        for sample, kept, value in sorted(rows, key=_order):
            labels = ",".join(f'{k}="{v}"' for k, v in kept)
            lines.append(f"{sample}{{{labels}}} {value}" if labels else f"{sample} {value}")
    return "\n".join(lines) + "\n"


def _order(row: tuple[str, tuple[tuple[str, str], ...], float]) -> tuple:
    """Samples in exposition order: by name, labels, and numeric `le` for buckets."""
    sample, kept, _ = row
    le = dict(kept).get("le")
    rest = tuple((k, v) for k, v in kept if k != "le")
    bound = float("inf") if le in (None, "+Inf") else float(le)
    return sample, rest, bound
