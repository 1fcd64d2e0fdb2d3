"""What one `mpic bench load` run measured (CLI process): `LoadResult` (admitted, rejected and
failed requests, TTFT percentiles of the admitted, throughput (answered and refused requests per
second), rejections by status and code and as the server counted them, the waits they
announced, the replicas' RSS over the run), and `write_outputs`: the printed tables, the JSON
and the PNG (TTFT over time, its distribution, RSS per deployment over time).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class LoadResult:
    """Figures of one load run."""

    clients: int
    duration_s: float
    requests: int
    errors: int
    ttft_p50_s: float
    ttft_p99_s: float
    output_tokens: int
    output_tokens_per_s: float
    requests_per_s: float
    """Answered (admitted and served) requests per second: the goodput."""
    error_samples: list[str] = field(default_factory=list)
    samples: list[tuple[float, float]] = field(default_factory=list)
    """(start offset s, TTFT s) of every successful request."""
    mode: str = "closed"
    rate: float | None = None
    """Open loop: arrivals per second (Poisson)."""
    sent: int = 0
    rejected: int = 0
    """Answers 429/503 (admission control), each with Retry-After."""
    rejected_by_status: dict[str, int] = field(default_factory=dict)
    rejected_without_retry_after: int = 0
    rejected_latency_p99_s: float = 0.0
    rss_mb: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    """Deployment -> (offset s, summed RSS MB of its local replica processes)."""
    abandoned: int = 0
    after_abandon_s: float | None = None
    """Seconds until a small request was served after `abandoned` dropped streams."""
    burst: int = 0
    """`--burst N`: N requests sent at once (one round) instead of the timed loop."""
    rejected_by_code: dict[str, int] = field(default_factory=dict)
    """Rejections by the JSON body's `error.code` (server_overloaded, engine_unavailable, ...)."""
    rejected_not_json: int = 0
    """Rejections whose body is not the OpenAI-style JSON error (e.g. a proxy's plain text)."""
    retry: str = "openai"
    """Closed loop: how a refused client waited before it retried (`bench.retry_delay_s`):
    "openai" (the announced wait, else exponential backoff), "fixed" (0.2 s), "retry-after"
    (the integer Retry-After, else 0.2 s)."""
    rejected_per_s: float = 0.0
    """Refusals (429/503) per second of the run."""
    retry_after_p50_s: float | None = None
    retry_after_max_s: float | None = None
    """Median and largest wait the refusals announced (`retry-after-ms`, else `Retry-After`)."""
    metrics_rejected: dict[str, float] = field(default_factory=dict)
    """Growth of the server's `mpic_requests_total{outcome=429|503}` for the chat route over
    the run (scraped from /metrics before and after)."""
    ttft_target_s: float | None = None
    """The server's `limits.ttft_target_s`, when the command knows its config."""
    server_ttft: dict[float, float] = field(default_factory=dict)
    """Growth of the server's own TTFT histogram over the run (`vllm:time_to_first_token_seconds`
    on /metrics: the chat route's receipt -> first token; bucket bound s -> cumulative count).
    The clients' TTFT adds what precedes the route (the client, Serve's proxy, the ingress's
    middleware), which on a starved CPU is seconds."""


def write_outputs(res: LoadResult, json_out: str | None, plot: str | None) -> None:
    """Print the table; write JSON and the PNG plot when asked."""
    from rich.console import Console
    from rich.table import Table

    who = f"{res.rate:g} req/s Poisson" if res.rate else f"{res.clients} clients"
    who = f"burst of {res.burst}" if res.burst else who
    who = f"{who}, retry {res.retry}" if res.mode == "closed" and not res.burst else who
    table = Table(title=f"load: {who}, {res.duration_s:.1f} s")
    cols = [
        "sent",
        "admitted",
        "rejected",
        "errors",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "out tok/s",
        "answered/s",
        "refused/s",
    ]
    for col in cols:
        table.add_column(col, justify="right")
    table.add_row(
        str(res.sent),
        str(res.requests),
        f"{res.rejected} {res.rejected_by_status}" if res.rejected else "0",
        str(res.errors),
        f"{res.ttft_p50_s * 1e3:.1f}",
        f"{res.ttft_p99_s * 1e3:.1f}",
        f"{res.output_tokens_per_s:.1f}",
        f"{res.requests_per_s:.2f}",
        f"{res.rejected_per_s:.2f}",
    )
    Console().print(table)
    if res.rejected:
        Console().print(
            f"rejections: {res.rejected - res.rejected_not_json} of {res.rejected} OpenAI-style "
            f"JSON, {res.rejected - res.rejected_without_retry_after} with Retry-After, p99 "
            f"{res.rejected_latency_p99_s * 1e3:.0f} ms, by code {res.rejected_by_code}; counted "
            f"by the server (/metrics): {res.metrics_rejected or 'none'}"
        )
    if res.retry_after_p50_s is not None:
        Console().print(
            f"announced waits (retry-after-ms, else Retry-After): p50 "
            f"{res.retry_after_p50_s:.2f} s, max {res.retry_after_max_s:.2f} s"
        )
    if res.ttft_target_s is not None:
        Console().print(
            f"admitted TTFT p99 {res.ttft_p99_s:.2f} s against the target "
            f"{res.ttft_target_s:g} s (limits.ttft_target_s)"
        )
    if res.server_ttft:
        Console().print(server_ttft_line(res.server_ttft, res.ttft_target_s))
    if res.rss_mb:
        rss = Table(title="RSS per deployment (MB): first / max / last")
        for col in ["deployment", "first", "max", "last"]:
            rss.add_column(col, justify="right")
        for dep, series in sorted(res.rss_mb.items()):
            mb = [v for _, v in series]
            rss.add_row(dep, f"{mb[0]:.0f}", f"{max(mb):.0f}", f"{mb[-1]:.0f}")
        Console().print(rss)
    if res.abandoned:
        Console().print(
            f"after {res.abandoned} abandoned streams the next request's first token came in "
            f"{res.after_abandon_s:.2f} s"
        )
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps(asdict(res), indent=1))
    if plot and res.samples:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        t, ttft = np.array(res.samples).T
        fig, (a, b, m) = plt.subplots(1, 3, figsize=(15, 3.5))
        a.scatter(t, ttft * 1e3, s=4)
        a.set(xlabel="request start (s)", ylabel="TTFT (ms)", title="TTFT over the run")
        b.hist(ttft * 1e3, bins=40)
        b.set(
            xlabel="TTFT (ms)",
            ylabel="requests",
            title=f"p50 {res.ttft_p50_s * 1e3:.0f} ms, p99 {res.ttft_p99_s * 1e3:.0f} ms",
        )
        for dep, series in sorted(res.rss_mb.items()):
            ts, mb = np.array(series).T
            m.plot(ts, mb, label=dep)
        m.set(xlabel="time (s)", ylabel="RSS (MB)", title="replica memory")
        if res.rss_mb:
            m.legend(fontsize=7)
        fig.tight_layout()
        Path(plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(plot, dpi=120)
        plt.close(fig)


def server_ttft_line(buckets: dict[float, float], target_s: float | None) -> str:
    """How many first tokens the server itself timed within the target (its histogram's bucket
    at the target, or the largest bucket under it)."""
    total = buckets.get(float("inf"), max(buckets.values(), default=0.0))
    under = [le for le in buckets if le != float("inf") and (target_s is None or le <= target_s)]
    if not under or not total:
        return f"server-timed TTFT: {total:.0f} first tokens"
    le = max(under)
    return (
        f"server-timed TTFT (the ingress's vllm:time_to_first_token_seconds, route -> first "
        f"token): {buckets[le]:.0f} of {total:.0f} within {le:g} s"
    )
