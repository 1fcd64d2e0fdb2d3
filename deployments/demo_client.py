"""The HTTP demo (CLI process): `mpic demo --http` / `python -m mpic.deployments.demo_client`.

Starts the embedded server in this process if none answers at the URL, uploads three images,
asks one interleaved question (text, image, text, image, text, image, text) with every policy
over streaming HTTP and prints each answer with the TTFT the client saw and the linked tokens.
"""

from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass

import httpx
import numpy as np
import typer

DEFAULT_POLICIES = "full,prefix,full-reuse,cacheblend-15,mpic-8,mpic-32"


@dataclass
class DemoRow:
    """One policy's answer."""

    policy: str
    answer: str
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


def demo_images() -> list[tuple[str, bytes]]:
    """Three small deterministic PNGs: a red square, a blue disc, a green gradient."""
    from PIL import Image, ImageDraw

    out = []
    red = Image.new("RGB", (64, 64), "white")
    ImageDraw.Draw(red).rectangle([12, 12, 52, 52], fill="red")
    blue = Image.new("RGB", (64, 64), "white")
    ImageDraw.Draw(blue).ellipse([8, 8, 56, 56], fill="blue")
    ramp = np.linspace(0, 255, 64, dtype=np.uint8)
    green = Image.fromarray(np.stack([ramp * 0, np.tile(ramp, (64, 1)), ramp * 0 + 40], -1)
                            .astype(np.uint8))
    for name, img in [("red-square.png", red), ("blue-disc.png", blue), ("green.png", green)]:
        buf = io.BytesIO()
        img.save(buf, "PNG")
        out.append((name, buf.getvalue()))
    return out


def ask(http: httpx.Client, file_ids: list[str], policy: str, max_tokens: int) -> DemoRow:
    """One streaming interleaved question; TTFT = first content chunk."""
    a, b, c = file_ids
    content = [
        {"type": "text", "text": "Here is the first picture:"},
        {"type": "file", "file": {"file_id": a}},
        {"type": "text", "text": "and the second:"},
        {"type": "file", "file": {"file_id": b}},
        {"type": "text", "text": "Which one looks more like this third picture?"},
        {"type": "file", "file": {"file_id": c}},
        {"type": "text", "text": "Answer briefly."},
    ]
    body = {"model": "mpic", "stream": True, "max_tokens": max_tokens,
            "stream_options": {"include_usage": True}, "mpic": {"policy": policy},
            "messages": [{"role": "user", "content": content}]}
    t0, ttft, text, usage = time.perf_counter(), None, [], {}
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{policy}: HTTP {resp.status_code} {resp.read().decode()}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                piece = choice["delta"].get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(piece)
            usage = chunk.get("usage") or usage
    return DemoRow(policy, "".join(text), ttft or float("nan"), usage.get("prompt_tokens", 0),
                   usage.get("prompt_tokens_details", {}).get("cached_tokens", 0))


def run_demo(url: str, key: str, policies: list[str], max_tokens: int) -> list[DemoRow]:
    """Upload the three images and ask with every policy (one warm-up request first)."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"},
                      timeout=300) as http:
        ids = []
        for name, data in demo_images():
            resp = http.post("/v1/files", files={"file": (name, data, "image/png")},
                             data={"purpose": "vision", "ttl_seconds": "3600"})
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
        table.add_row(r.policy, f"{r.ttft_s * 1e3:.1f}", speed,
                      f"{r.cached_tokens}/{r.prompt_tokens}", repr(r.answer))
    Console().print(table)


def command(
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help="Server to use or start."),
    key: str = typer.Option("mpic-dev-alice", "--key", help="API key (dev key by default)."),
    policies: str = typer.Option(DEFAULT_POLICIES, "--policies"),
    max_tokens: int = typer.Option(8, "--max-tokens", min=1, max=256),
) -> None:
    """Start the server if none runs, upload three images, ask, print answer + TTFT per policy."""
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


if __name__ == "__main__":
    typer.run(command)
