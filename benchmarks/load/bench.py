"""`mpic bench load` (CLI process): a bounded loopback load run against the HTTP API.

Closed loop (default): C concurrent clients (asyncio + httpx) each loop for `duration` seconds:
one streaming chat completion that links the same cached files in a client-specific interleaved
prompt. A refused client waits as OpenAI's Python client does before it retries (`--retry
openai`, the default; `retry_delay_s`): the wait the refusal announces (`retry-after-ms`, else
`Retry-After`) when it is within (0, 120] s, else an exponential backoff (0.5 s doubling per
refusal in a row, at most 8 s, less up to 25 % jitter). `--retry fixed` keeps the earlier
default, a retry 0.2 s after each refusal (the load tables of docs/serving.md before "Refusals
that say when to come back"), and `--retry retry-after` the earlier `--honor-retry-after` (the
integer `Retry-After`, else 0.2 s).
Open loop (`--rate R`): requests arrive as a Poisson process of R per second whatever the
server does (each arrival its own task), the way overload really comes.

Every answer is admitted (200), rejected (429/503 with `Retry-After`: the admission control) or an
error. Reports admitted / rejected / errors, TTFT p50/p99 of the admitted (first SSE content
chunk), output tokens/s, answered (goodput) and refused requests per second, the waits the
refusals announced, and the RSS of every Serve deployment's replica processes over the run
(sampled each second from the local processes Ray names `ServeReplica:<app>:<Deployment>`).
`--abandon N` first opens N streams, drops each after its first chunk (with `--abandon-queued`:
all of them once the first streams, the others still queued), and times the next small request
(cancellation). `--burst N` sends N requests at once instead of the timed loop. Rejections are
checked to be OpenAI-style JSON with `Retry-After` and compared with the server's own count
(`mpic_requests_total` on /metrics, before and after). Prints a table, writes JSON and a PNG
(TTFT over time, its distribution, RSS per deployment over time).

This module drives the run; one request and its classification are
`mpic.benchmarks.load.requests`, the replicas' RSS `mpic.benchmarks.load.replica_rss`, the
figures and outputs `mpic.benchmarks.load.report`.
"""

from __future__ import annotations

import asyncio
import io
import logging
import math
import random
import time

import httpx
import numpy as np
import typer

from mpic.benchmarks.chat_client import sse_chunk, streaming_chat_body
from mpic.benchmarks.load.replica_rss import RssSampler
from mpic.benchmarks.load.report import LoadResult, write_outputs
from mpic.benchmarks.load.requests import (
    announced_wait_s,
    metrics_rejections,
    metrics_ttft,
    send_one,
)

logger = logging.getLogger(__name__)


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


def _body(cid: int, turn: int, file_ids: list[str], policy: str, max_tokens: int) -> dict:
    content = [{"type": "text", "text": f"client {cid} turn {turn}: compare"}]
    for fid in file_ids:
        content += [{"type": "file", "file": {"file_id": fid}}, {"type": "text", "text": "and"}]
    return streaming_chat_body(content, policy, max_tokens)


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


RETRY_POLICIES = ("openai", "fixed", "retry-after")
"""How a refused closed-loop client waits before it retries (`retry_delay_s`)."""
FIXED_RETRY_S = 0.2
"""`--retry fixed`: the earlier default wait after a refusal."""
OPENAI_MAX_RETRY_AFTER_S = 120.0
"""OpenAI's Python client honours an announced wait up to this (`MAX_RETRY_AFTER_DELAY`)."""


def retry_delay_s(
    policy: str, headers: httpx.Headers, attempt: int, rng: random.Random | None = None
) -> float:
    """Seconds a refused client waits before its next try. `attempt`: refusals in a row before
    this one (0 for the first). "openai": as OpenAI's Python client (`_calculate_retry_timeout`):
    the announced wait (`announced_wait_s`: `retry-after-ms`, else `Retry-After`) when it is in
    (0, 120] s, else `min(0.5 · 2^attempt, 8)` s less up to 25 % jitter; "retry-after": the
    integer `Retry-After`, else 0.2 s (the earlier `--honor-retry-after`); "fixed": 0.2 s."""
    if policy == "fixed":
        return FIXED_RETRY_S
    if policy == "retry-after":
        raw = headers.get("retry-after") or ""
        return float(raw) if raw.isdigit() else FIXED_RETRY_S
    if policy != "openai":
        raise ValueError(f"unknown retry policy {policy!r} (one of {RETRY_POLICIES})")
    wait = announced_wait_s(headers)
    if wait is not None and math.isfinite(wait) and 0 < wait <= OPENAI_MAX_RETRY_AFTER_S:
        return wait
    backoff = min(0.5 * 2.0 ** min(attempt, 1000), 8.0)
    return backoff * (1 - 0.25 * (rng or random).random())


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
    retry: str = "openai",
    announced: list | None = None,
) -> None:
    turn, in_a_row, rng = 0, 0, random.Random(cid)
    while time.perf_counter() < t_end:
        turn += 1
        body = _body(cid, turn, file_ids, policy, max_tokens)
        refused = await send_one(http, body, t_start, out, rejected_lat, announced)
        if refused is None:
            in_a_row = 0
            continue
        wait = retry_delay_s(retry, refused, in_a_row, rng)  # a refused client backs off
        in_a_row += 1
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
    retry: str = "openai",
) -> LoadResult:
    """Run `clients` closed-loop clients, or open-loop Poisson arrivals at `rate`/s, for
    `duration_s` against `url` (after the `abandon` probe when asked); or, with `burst`, send
    `burst` requests at once and wait for every answer. The server's counted rejections
    (/metrics) are scraped before and after. `retry`: how a refused closed-loop client waits
    (`retry_delay_s`); the open loop and the burst do not retry."""
    if retry not in RETRY_POLICIES:
        raise ValueError(f"unknown retry policy {retry!r} (one of {RETRY_POLICIES})")
    out = LoadResult(clients, duration_s, 0, 0, 0.0, 0.0, 0, 0.0, 0.0)
    out.mode, out.rate = ("open", rate) if rate else ("closed", None)
    out.mode, out.burst = ("burst", burst) if burst else (out.mode, 0)
    out.retry = retry
    conns = clients + abandon + 4 if not rate else max(64, int(rate * 30))
    conns = max(conns, burst + 4)
    limits = httpx.Limits(max_connections=conns)
    rejected_lat: list[float] = []
    announced: list[float] = []
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120, limits=limits
    ) as http:
        if abandon:
            out.abandoned = abandon
            out.after_abandon_s = await abandon_probe(
                http, file_ids, policy, abandon, 256, queued=abandon_queued
            )
        counted_before = await metrics_rejections(http)
        ttft_before = await metrics_ttft(http)
        t_start = time.perf_counter()
        t_end = t_start + duration_s
        with RssSampler(out, t_start):
            if burst:
                await asyncio.gather(
                    *(
                        send_one(
                            http,
                            _body(i, 0, file_ids, policy, max_tokens),
                            t_start,
                            out,
                            rejected_lat,
                            announced,
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
                    tasks.append(
                        asyncio.create_task(
                            send_one(http, body, t_start, out, rejected_lat, announced)
                        )
                    )
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
                            retry,
                            announced,
                        )
                        for i in range(clients)
                    ]
                )
        elapsed = time.perf_counter() - t_start
        if out.rejected:  # Ray's metrics agents export every few seconds: wait for the count
            deadline = time.perf_counter() + 30
            while True:
                after = await metrics_rejections(http)
                grown = {k: after.get(k, 0.0) - counted_before.get(k, 0.0) for k in after}
                if sum(grown.values()) >= out.rejected or time.perf_counter() > deadline:
                    break
                await asyncio.sleep(1)
            out.metrics_rejected = grown
        if out.requests:  # the server's own TTFT histogram, once its export caught up
            deadline = time.perf_counter() + 30
            while True:
                after_ttft = await metrics_ttft(http)
                grown_ttft = {
                    le: n - ttft_before.get(le, 0.0) for le, n in sorted(after_ttft.items())
                }
                if grown_ttft.get(float("inf"), 0.0) >= out.requests or (
                    time.perf_counter() > deadline or not after_ttft
                ):
                    break
                await asyncio.sleep(1)
            out.server_ttft = grown_ttft
    if rejected_lat:
        out.rejected_latency_p99_s = float(np.percentile(rejected_lat, 99))
    if announced:
        out.retry_after_p50_s = float(np.percentile(announced, 50))
        out.retry_after_max_s = float(max(announced))
    ttfts = np.array([s[1] for s in out.samples]) if out.samples else np.zeros(1)
    out.duration_s = elapsed
    out.ttft_p50_s = float(np.percentile(ttfts, 50))
    out.ttft_p99_s = float(np.percentile(ttfts, 99))
    out.output_tokens_per_s = out.output_tokens / elapsed
    out.requests_per_s = out.requests / elapsed
    out.rejected_per_s = out.rejected / elapsed
    return out


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
    retry: str = typer.Option(
        "openai",
        "--retry",
        help="Closed loop: how a refused client waits before it retries: openai (as OpenAI's "
        "Python client: retry-after-ms / Retry-After, else exponential backoff), fixed (0.2 s, "
        "the earlier default), retry-after (the integer Retry-After, else 0.2 s).",
    ),
    honor_retry_after: bool = typer.Option(
        False,
        "--honor-retry-after",
        hidden=True,
        help="The earlier flag: --retry retry-after.",
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

    if retry not in RETRY_POLICIES:
        raise typer.BadParameter(f"one of {', '.join(RETRY_POLICIES)}", param_hint="--retry")
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
                retry="retry-after" if honor_retry_after else retry,
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
