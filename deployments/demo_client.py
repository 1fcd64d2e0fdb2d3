"""The HTTP demo (CLI process): `mpic demo` / `python -m mpic.deployments.demo_client`.

Starts the embedded server in this process if none answers at the URL, uploads the offline
demo's three images, asks its interleaved question (text before, between and after the images)
with every policy over streaming HTTP and prints each answer with the TTFT the client saw and
the linked tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
import typer

from mpic.deployments.chat_client import sse_chunk, streaming_chat_body

DEFAULT_POLICIES = "full,prefix,full-reuse,cacheblend-15,mpic-32,vlcache-0.1"


@dataclass
class DemoRow:
    """One policy's answer."""

    policy: str
    answer: str
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


def ask(http: httpx.Client, file_ids: list[str], policy: str, max_tokens: int) -> DemoRow:
    """The offline demo's interleaved question (`interleaved_prompt`) with the images as cached
    files, streamed; TTFT = the first content chunk."""
    from mpic.samples import interleaved_prompt

    content = [
        {"type": "text", "text": p}
        if isinstance(p, str)
        else {"type": "file", "file": {"file_id": p.entry_id}}
        for p in interleaved_prompt(file_ids)
    ]
    body = streaming_chat_body(content, policy, max_tokens)
    t0, ttft, text, usage = time.perf_counter(), None, [], {}
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{policy}: HTTP {resp.status_code} {resp.read().decode()}")
        for line in resp.iter_lines():
            chunk = sse_chunk(line)
            if chunk is None:
                continue
            for choice in chunk["choices"]:
                piece = choice["delta"].get("content")
                if piece is not None:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(piece)
            usage = chunk.get("usage") or usage
    return DemoRow(
        policy,
        "".join(text),
        ttft or float("nan"),
        usage.get("prompt_tokens", 0),
        usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
    )


def run_demo(url: str, key: str, policies: list[str], max_tokens: int) -> list[DemoRow]:
    """Upload the three images and ask with every policy (one warm-up request first)."""
    from mpic.samples import synthetic_png

    with httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=300
    ) as http:
        ids = []
        for i in range(3):  # the offline demo's three images
            data = synthetic_png(i)
            resp = http.post(
                "/v1/files",
                files={"file": (f"trip-{i}.png", data, "image/png")},
                data={"purpose": "vision", "ttl_seconds": "3600"},
            )
            resp.raise_for_status()
            ids.append(resp.json()["id"])
        ask(http, ids, policies[0], 1)  # warm-up: first-request costs are not a policy's
        return [ask(http, ids, p, max_tokens) for p in policies]


def print_rows(rows: list[DemoRow]) -> None:
    """A rich table: policy, TTFT, speed-up over `full`, linked tokens, answer."""
    from rich.console import Console
    from rich.table import Table

    base = next((r.ttft_s for r in rows if r.policy == "full"), None)
    table = Table(title="MPIC demo over HTTP (one interleaved question, three cached images)")
    for col in ["policy", "TTFT ms", "vs full", "cached/prompt tokens", "answer"]:
        table.add_column(col)
    for r in rows:
        speed = f"{base / r.ttft_s:.2f}x" if base else "-"
        table.add_row(
            r.policy,
            f"{r.ttft_s * 1e3:.1f}",
            speed,
            f"{r.cached_tokens}/{r.prompt_tokens}",
            repr(r.answer),
        )
    Console().print(table)


def http_demo(
    url: str = "http://127.0.0.1:8000",
    key: str = "mpic-dev-alice",
    policies: str = DEFAULT_POLICIES,
    max_tokens: int = 8,
) -> None:
    """Start the embedded server if none answers at `url`, run the demo, print the table."""
    from mpic.deployments.config import load_config
    from mpic.deployments.local import is_serving, start_local, stop_local

    started = not is_serving(url)
    if started:
        port = httpx.URL(url).port or 8000
        typer.echo(f"no server at {url}: starting the embedded default (first start ~1 min)")
        url = start_local(load_config(None), port=port, log_to_driver=False)
    try:
        print_rows(run_demo(url, key, [p for p in policies.split(",") if p], max_tokens))
    finally:
        if started:
            stop_local()


def command(
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help="Server to use or start."),
    key: str = typer.Option("mpic-dev-alice", "--key", help="API key (dev key by default)."),
    policies: str = typer.Option(DEFAULT_POLICIES, "--policies"),
    max_tokens: int = typer.Option(8, "--max-tokens", min=1, max=256),
) -> None:
    """Start the server if none runs, upload three images, ask, print answer + TTFT per policy."""
    http_demo(url, key, policies, max_tokens)


if __name__ == "__main__":
    typer.run(command)
