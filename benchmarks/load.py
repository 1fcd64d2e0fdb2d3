"""`mpic bench load` (CLI process): a bounded loopback load run against the HTTP API.

Closed loop (default): C concurrent clients (asyncio + httpx) each loop for `duration` seconds:
one streaming chat completion that links the same cached files in a client-specific interleaved
prompt. Open loop (`--rate R`): requests arrive as a Poisson process of R per second whatever the
server does (each arrival its own task), the way overload really comes.

Every answer is admitted (200), rejected (429/503 with `Retry-After`: the admission control) or an
error. Reports admitted / rejected / errors, TTFT p50/p99 of the admitted (first SSE content
chunk), output tokens/s, and the RSS of every Serve deployment's replica processes over the run
(sampled each second from the local processes Ray names `ServeReplica:<app>:<Deployment>`).
`--abandon N` first opens N streams, drops each after its first chunk (with `--abandon-queued`:
all of them once the first streams, the others still queued), and times the next small request
(cancellation). `--burst N` sends N requests at once instead of the timed loop. Rejections are
checked to be OpenAI-style JSON with `Retry-After` and compared with the server's own count
(`mpic_requests_total` on /metrics, before and after). Prints a table, writes JSON and a PNG
(TTFT over time, its distribution, RSS per deployment over time).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import random
import re
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
import typer

from mpic.deployments.http.chat_client import sse_chunk, streaming_chat_body

logger = logging.getLogger(__name__)


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
    honor_retry_after: bool = False
    """Closed loop: a rejected client waited the answer's Retry-After (else 0.2 s)."""
    """Rejections whose body is not the OpenAI-style JSON error (e.g. a proxy's plain text)."""
    metrics_rejected: dict[str, float] = field(default_factory=dict)
    """Growth of the server's `mpic_requests_total{outcome=429|503}` for the chat route over
    the run (scraped from /metrics before and after)."""
    ttft_target_s: float | None = None
    """The server's `limits.ttft_target_s`, when the command knows its config."""


def make_png(seed: int, side: int = 32) -> bytes:
    """A small random RGB PNG (the load run's uploads)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def upload_images(url: str, key: str, n: int) -> list[str]:
    """Upload `n` random images; returns their file ids."""
    ids = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as c:
        for i in range(n):
            files = {"file": (f"load-{i}.png", make_png(1000 + i), "image/png")}
            resp = c.post("/v1/files", files=files, data={"purpose": "vision"})
            resp.raise_for_status()
            ids.append(resp.json()["id"])
    return ids


class _Rejected(Exception):
    def __init__(self, status: int, retry_after: str | None) -> None:
        super().__init__(f"HTTP {status}")
        self.status, self.retry_after = status, retry_after


async def _one(
    http: httpx.AsyncClient, body: dict, t_start: float, out: LoadResult, rejected_lat: list
) -> str | None:
    """One streaming request, classified as admitted, rejected (429/503) or an error; the
    Retry-After of a rejection (None otherwise)."""
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    out.sent += 1
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code in (429, 503):
                raw = await resp.aread()
                out.rejected_not_json += not _is_json_error(resp.headers, raw)
                code = _error_code(raw)
                out.rejected_by_code[code] = out.rejected_by_code.get(code, 0) + 1
                raise _Rejected(resp.status_code, resp.headers.get("retry-after"))
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
            async for line in resp.aiter_lines():
                chunk = sse_chunk(line)
                if chunk is None:
                    continue
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error'].get('code')}")
                if (
                    ttft is None
                    and chunk["choices"]
                    and chunk["choices"][0]["delta"].get("content")
                ):
                    ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        if ttft is None:
            raise RuntimeError("stream ended without content")
        out.requests += 1
        out.output_tokens += tokens
        out.samples.append((t0 - t_start, ttft))
    except _Rejected as rej:
        out.rejected += 1
        key = str(rej.status)
        out.rejected_by_status[key] = out.rejected_by_status.get(key, 0) + 1
        out.rejected_without_retry_after += rej.retry_after is None
        rejected_lat.append(time.perf_counter() - t0)
        return rej.retry_after
    except (httpx.HTTPError, RuntimeError, json.JSONDecodeError, KeyError) as exc:
        out.errors += 1
        if len(out.error_samples) < 5:
            out.error_samples.append(f"{type(exc).__name__}: {exc}")


def _is_json_error(headers: httpx.Headers, raw: bytes) -> bool:
    """True for an OpenAI-style JSON error body."""
    if not headers.get("content-type", "").startswith("application/json"):
        return False
    try:
        return set(json.loads(raw)["error"]) >= {"message", "type", "code"}
    except (ValueError, KeyError, TypeError):
        return False


def _error_code(raw: bytes) -> str:
    """`error.code` of a JSON error body ("?" when there is none)."""
    try:
        return str(json.loads(raw)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "?"


_REQUEST_SERIES = ("mpic_requests_total", "ray_mpic_requests_total")
"""The ingress's request counter as Ray's metrics agent exports it (with or without `ray_`)."""


def rejections_in_metrics(text: str) -> dict[str, float]:
    """`mpic_requests_total` of the chat route by rejection outcome (429, 503) in a Prometheus
    text, summed over replicas and nodes."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name not in _REQUEST_SERIES or "/v1/chat/completions" not in line:
            continue
        for status in ("429", "503"):
            if f'outcome="{status}"' in line:
                out[status] = out.get(status, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def _metrics_rejections(http: httpx.AsyncClient) -> dict[str, float]:
    try:
        return rejections_in_metrics((await http.get("/metrics")).text)
    except httpx.HTTPError:
        return {}


def _body(cid: int, turn: int, file_ids: list[str], policy: str, max_tokens: int) -> dict:
    content = [{"type": "text", "text": f"client {cid} turn {turn}: compare"}]
    for fid in file_ids:
        content += [{"type": "file", "file": {"file_id": fid}}, {"type": "text", "text": "and"}]
    return streaming_chat_body(content, policy, max_tokens)


_REPLICA = re.compile(r"ServeReplica:[^:\s]+:(\w+)")


def sample_rss() -> dict[str, float]:
    """Summed RSS (MB) of the local Serve replica processes, by deployment."""
    import psutil

    out: Counter[str] = Counter()
    for proc in psutil.process_iter(["cmdline", "memory_info"]):
        try:
            title = " ".join(proc.info["cmdline"] or [])
            m = _REPLICA.search(title)
            if m and proc.info["memory_info"] is not None:
                out[m.group(1)] += proc.info["memory_info"].rss / 2**20
        except (psutil.Error, TypeError):
            continue
    return dict(out)


class RssSampler:
    """Samples `sample_rss` every `period_s` on a thread into `out.rss_mb`."""

    def __init__(self, out: LoadResult, t_start: float, period_s: float = 1.0) -> None:
        self.out, self.t_start, self.period = out, t_start, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter() - self.t_start
            for dep, mb in sample_rss().items():
                self.out.rss_mb.setdefault(dep, []).append((round(t, 2), round(mb, 1)))
            self._stop.wait(self.period)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


async def abandon_probe(
    http: httpx.AsyncClient,
    file_ids: list[str],
    policy: str,
    n: int,
    max_tokens: int,
    queued: bool = False,
) -> float:
    """Open `n` long streams, drop each after its first chunk (a client disconnect), then time a
    small request until its first content chunk. `queued`: drop every stream as soon as the
    first of them streams (on an engine that serves one request at a time, the others are
    still queued)."""

    async def drop(i: int) -> None:
        body = _body(10_000 + i, 0, file_ids, policy, max_tokens)
        async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if sse_chunk(line) is not None:
                    break  # leaving the block closes the connection mid-stream

    if queued:  # all leave once the first one streams: the others never got the engine
        tasks = [asyncio.create_task(drop(i)) for i in range(n)]
        _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in pending:
            t.cancel()  # closes the connection of a stream still waiting for its first chunk
        await asyncio.gather(*pending, return_exceptions=True)
    else:
        await asyncio.gather(*(drop(i) for i in range(n)))
    t0 = time.perf_counter()
    body = _body(20_000, 0, [], policy, 2)
    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            chunk = sse_chunk(line)
            if chunk and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                break
    return time.perf_counter() - t0


async def _client(
    cid: int,
    http: httpx.AsyncClient,
    file_ids: list[str],
    policy: str,
    max_tokens: int,
    t_start: float,
    t_end: float,
    out: LoadResult,
    rejected_lat: list,
    honor_retry_after: bool = False,
) -> None:
    turn = 0
    while time.perf_counter() < t_end:
        turn += 1
        before = out.rejected
        body = _body(cid, turn, file_ids, policy, max_tokens)
        retry = await _one(http, body, t_start, out, rejected_lat)
        if out.rejected > before:  # a rejected closed-loop client backs off (0.2 s or as told)
            wait = float(retry) if honor_retry_after and (retry or "").isdigit() else 0.2
            await asyncio.sleep(min(wait, max(0.0, t_end - time.perf_counter())))


async def run_load_async(
    url: str,
    key: str,
    file_ids: list[str],
    clients: int,
    duration_s: float,
    policy: str = "mpic-32",
    max_tokens: int = 8,
    rate: float | None = None,
    abandon: int = 0,
    seed: int = 0,
    burst: int = 0,
    abandon_queued: bool = False,
    honor_retry_after: bool = False,
) -> LoadResult:
    """Run `clients` closed-loop clients, or open-loop Poisson arrivals at `rate`/s, for
    `duration_s` against `url` (after the `abandon` probe when asked); or, with `burst`, send
    `burst` requests at once and wait for every answer. The server's counted rejections
    (/metrics) are scraped before and after."""
    out = LoadResult(clients, duration_s, 0, 0, 0.0, 0.0, 0, 0.0, 0.0)
    out.mode, out.rate = ("open", rate) if rate else ("closed", None)
    out.mode, out.burst = ("burst", burst) if burst else (out.mode, 0)
    out.honor_retry_after = honor_retry_after
    conns = clients + abandon + 4 if not rate else max(64, int(rate * 30))
    conns = max(conns, burst + 4)
    limits = httpx.Limits(max_connections=conns)
    rejected_lat: list[float] = []
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120, limits=limits
    ) as http:
        if abandon:
            out.abandoned = abandon
            out.after_abandon_s = await abandon_probe(
                http, file_ids, policy, abandon, 256, queued=abandon_queued
            )
        counted_before = await _metrics_rejections(http)
        t_start = time.perf_counter()
        t_end = t_start + duration_s
        with RssSampler(out, t_start):
            if burst:
                await asyncio.gather(
                    *(
                        _one(
                            http,
                            _body(i, 0, file_ids, policy, max_tokens),
                            t_start,
                            out,
                            rejected_lat,
                        )
                        for i in range(burst)
                    )
                )
            elif rate:
                rng, tasks, n = random.Random(seed), [], 0
                next_t = t_start
                while (next_t := next_t + rng.expovariate(rate)) < t_end:
                    await asyncio.sleep(max(0.0, next_t - time.perf_counter()))
                    n += 1
                    body = _body(n, 0, file_ids, policy, max_tokens)
                    tasks.append(asyncio.create_task(_one(http, body, t_start, out, rejected_lat)))
                await asyncio.gather(*tasks)
            else:
                await asyncio.gather(
                    *[
                        _client(
                            i,
                            http,
                            file_ids,
                            policy,
                            max_tokens,
                            t_start,
                            t_end,
                            out,
                            rejected_lat,
                            honor_retry_after,
                        )
                        for i in range(clients)
                    ]
                )
        elapsed = time.perf_counter() - t_start
        if out.rejected:  # Ray's metrics agents export every few seconds: wait for the count
            deadline = time.perf_counter() + 30
            while True:
                after = await _metrics_rejections(http)
                grown = {k: after.get(k, 0.0) - counted_before.get(k, 0.0) for k in after}
                if sum(grown.values()) >= out.rejected or time.perf_counter() > deadline:
                    break
                await asyncio.sleep(1)
            out.metrics_rejected = grown
    if rejected_lat:
        out.rejected_latency_p99_s = float(np.percentile(rejected_lat, 99))
    ttfts = np.array([s[1] for s in out.samples]) if out.samples else np.zeros(1)
    out.duration_s = elapsed
    out.ttft_p50_s = float(np.percentile(ttfts, 50))
    out.ttft_p99_s = float(np.percentile(ttfts, 99))
    out.output_tokens_per_s = out.output_tokens / elapsed
    out.requests_per_s = out.requests / elapsed
    return out


def write_outputs(res: LoadResult, json_out: str | None, plot: str | None) -> None:
    """Print the table; write JSON and the PNG plot when asked."""
    from rich.console import Console
    from rich.table import Table

    who = f"{res.rate:g} req/s Poisson" if res.rate else f"{res.clients} clients"
    who = f"burst of {res.burst}" if res.burst else who
    table = Table(title=f"load: {who}, {res.duration_s:.1f} s")
    cols = [
        "sent",
        "admitted",
        "rejected",
        "errors",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "out tok/s",
        "req/s",
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
    )
    Console().print(table)
    if res.rejected:
        Console().print(
            f"rejections: {res.rejected - res.rejected_not_json} of {res.rejected} OpenAI-style "
            f"JSON, {res.rejected - res.rejected_without_retry_after} with Retry-After, p99 "
            f"{res.rejected_latency_p99_s * 1e3:.0f} ms, by code {res.rejected_by_code}; counted "
            f"by the server (/metrics): {res.metrics_rejected or 'none'}"
        )
    if res.ttft_target_s is not None:
        Console().print(
            f"admitted TTFT p99 {res.ttft_p99_s:.2f} s against the target "
            f"{res.ttft_target_s:g} s (limits.ttft_target_s)"
        )
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


def command(
    url: str = typer.Option(None, "--url", help="Running server; default: start the embedded."),
    key: str = typer.Option("mpic-dev-alice", "--key", help="API key of the load user."),
    clients: int = typer.Option(16, "--clients", min=1, max=256),
    duration: float = typer.Option(60.0, "--duration", min=1, max=3600, help="Seconds."),
    images: int = typer.Option(2, "--images", min=0, max=16, help="Cached files per prompt."),
    policy: str = typer.Option("mpic-32", "--policy"),
    max_tokens: int = typer.Option(8, "--max-tokens", min=1, max=512),
    rate: float = typer.Option(
        None, "--rate", min=0.01, max=10000, help="Open loop: Poisson arrivals per second."
    ),
    abandon: int = typer.Option(
        0, "--abandon", min=0, max=256, help="First drop N streams mid-way; time the next one."
    ),
    burst: int = typer.Option(
        0, "--burst", min=0, max=10000, help="Send N requests at once instead of the timed loop."
    ),
    abandon_queued: bool = typer.Option(
        False,
        "--abandon-queued",
        help="With --abandon N: drop all N once the first streams (the rest still queued).",
    ),
    honor_retry_after: bool = typer.Option(
        False,
        "--honor-retry-after",
        help="Closed loop: a rejected client waits the answer's Retry-After (as OpenAI's "
        "clients do) instead of 0.2 s.",
    ),
    port: int = typer.Option(8000, "--port"),
    json_out: str = typer.Option("out/load.json", "--json"),
    plot: str = typer.Option("out/load.png", "--plot"),
    config: str = typer.Option(
        None, "--config", help="ServeAppConfig YAML of the started server (default: embedded)."
    ),
) -> None:
    """16 concurrent streaming clients for 60 s (defaults), or `--rate R` Poisson arrivals:
    admitted / rejected (429/503), TTFT p50/p99 of the admitted, RSS per deployment."""
    from mpic.deployments.config import load_config
    from mpic.deployments.local import start_local, stop_local

    started = url is None
    cfg = load_config(config) if started or config else None
    if started:
        url = start_local(cfg, port=port, log_to_driver=False)
    try:
        file_ids = upload_images(url, key, images)
        res = asyncio.run(
            run_load_async(
                url,
                key,
                file_ids,
                clients,
                duration,
                policy,
                max_tokens,
                rate,
                abandon,
                burst=burst,
                abandon_queued=abandon_queued,
                honor_retry_after=honor_retry_after,
            )
        )
        res.ttft_target_s = cfg.limits.ttft_target_s if cfg is not None else None
        write_outputs(res, json_out, plot)
    finally:
        if started:
            stop_local()
    if res.errors:
        typer.echo(f"{res.errors} errors, e.g. {res.error_samples}", err=True)
        raise typer.Exit(code=1)
