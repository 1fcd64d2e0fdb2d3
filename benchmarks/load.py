"""`mpic bench load` (CLI process): a bounded loopback load run against the HTTP API.

C concurrent clients (asyncio + httpx) each loop for `duration` seconds: one streaming chat
completion that links the same cached files in a client-specific interleaved prompt. Reports
TTFT p50/p99 (first SSE content chunk), output tokens/s over the run, request rate and errors;
prints a table, writes JSON and a PNG plot (TTFT over time and its distribution).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
import typer

from mpic.deployments.chat_client import sse_chunk, streaming_chat_body

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


async def _client(
    cid: int,
    http: httpx.AsyncClient,
    file_ids: list[str],
    policy: str,
    max_tokens: int,
    t_start: float,
    t_end: float,
    out: LoadResult,
) -> None:
    turn = 0
    while time.perf_counter() < t_end:
        turn += 1
        content = [{"type": "text", "text": f"client {cid} turn {turn}: compare"}]
        for fid in file_ids:
            content += [{"type": "file", "file": {"file_id": fid}}, {"type": "text", "text": "and"}]
        body = streaming_chat_body(content, policy, max_tokens)
        t0 = time.perf_counter()
        ttft, tokens = None, 0
        try:
            async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                async for line in resp.aiter_lines():
                    chunk = sse_chunk(line)
                    if chunk is None:
                        continue
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
        except (httpx.HTTPError, RuntimeError, json.JSONDecodeError, KeyError) as exc:
            out.errors += 1
            if len(out.error_samples) < 5:
                out.error_samples.append(f"{type(exc).__name__}: {exc}")


async def run_load_async(
    url: str,
    key: str,
    file_ids: list[str],
    clients: int,
    duration_s: float,
    policy: str = "mpic-32",
    max_tokens: int = 8,
) -> LoadResult:
    """Run `clients` concurrent streaming clients for `duration_s` against `url`."""
    out = LoadResult(clients, duration_s, 0, 0, 0.0, 0.0, 0, 0.0, 0.0)
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120, limits=limits
    ) as http:
        t_start = time.perf_counter()
        t_end = t_start + duration_s
        await asyncio.gather(
            *[
                _client(i, http, file_ids, policy, max_tokens, t_start, t_end, out)
                for i in range(clients)
            ]
        )
        elapsed = time.perf_counter() - t_start
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

    table = Table(title=f"load: {res.clients} clients, {res.duration_s:.1f} s")
    for col in ["requests", "errors", "TTFT p50 ms", "TTFT p99 ms", "out tok/s", "req/s"]:
        table.add_column(col, justify="right")
    table.add_row(
        str(res.requests),
        str(res.errors),
        f"{res.ttft_p50_s * 1e3:.1f}",
        f"{res.ttft_p99_s * 1e3:.1f}",
        f"{res.output_tokens_per_s:.1f}",
        f"{res.requests_per_s:.2f}",
    )
    Console().print(table)
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps(asdict(res), indent=1))
    if plot and res.samples:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        t, ttft = np.array(res.samples).T
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
        a.scatter(t, ttft * 1e3, s=4)
        a.set(xlabel="request start (s)", ylabel="TTFT (ms)", title="TTFT over the run")
        b.hist(ttft * 1e3, bins=40)
        b.set(
            xlabel="TTFT (ms)",
            ylabel="requests",
            title=f"p50 {res.ttft_p50_s * 1e3:.0f} ms, p99 {res.ttft_p99_s * 1e3:.0f} ms",
        )
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
    port: int = typer.Option(8000, "--port"),
    json_out: str = typer.Option("out/load.json", "--json"),
    plot: str = typer.Option("out/load.png", "--plot"),
    config: str = typer.Option(
        None, "--config", help="ServeAppConfig YAML of the started server (default: embedded)."
    ),
) -> None:
    """16 concurrent streaming clients for 60 s (defaults): TTFT p50/p99, output tokens/s."""
    from mpic.deployments.config import load_config
    from mpic.deployments.local import start_local, stop_local

    started = url is None
    if started:
        url = start_local(load_config(config), port=port, log_to_driver=False)
    try:
        file_ids = upload_images(url, key, images)
        res = asyncio.run(run_load_async(url, key, file_ids, clients, duration, policy, max_tokens))
        write_outputs(res, json_out, plot)
    finally:
        if started:
            stop_local()
    if res.errors:
        typer.echo(f"{res.errors} errors, e.g. {res.error_samples}", err=True)
        raise typer.Exit(code=1)
