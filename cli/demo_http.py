"""The HTTP demo (CLI process): `mpic demo` / `python -m mpic.cli.demo_http`.

Starts the embedded server in this process if none answers at the URL (the vLLM worker, on the
model `mpic demo` picks: LLaVA with the trained SmolLM2 by default), then:

1. the answer table (`mpic.cli.demo_answers`): uploads four text documents, one holding a planted
   secret code, asks for the code with `full`, `auto`, `mpic-32` and `full-reuse` over streaming
   HTTP and prints each answer with the TTFT the client saw (median of 3 requests), the speed-up
   over `full`, whether it equals full's answer and the cached share of the prompt;
2. if the model takes images: uploads the offline demo's three images, asks its interleaved
   question (text before, between and after the images) with every policy and prints each
   answer with the TTFT and the linked tokens. Then it sends the same question with `mpic-32`
   from 1, 2, 4 and 8 clients at once (each with its own closing sentence) and prints, per
   concurrency, the TTFT p50/max, the output tokens per second over the whole wave and the wall
   time against running the wave's requests one after another (`vs serial` = wave wall time /
   (concurrency x the single request's wall time); below 1 means the requests were batched).
   Skipped when the model takes no images (read from its config.json when the demo starts the
   server; a running server's model: when it answers the image upload with 400).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import typer

from mpic.benchmarks.chat_client import StreamedAnswer, streaming_chat_body
from mpic.cli.demo_answers import ANSWER_POLICIES

DEFAULT_POLICIES = "full,prefix,full-reuse,cacheblend-15,mpic-32,vlcache-0.1,auto"
DEFAULT_CONCURRENCY = "1,2,4,8"


@dataclass
class DemoRow:
    """One request's answer."""

    policy: str
    answer: str
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int = 0
    wall_s: float = 0.0


@dataclass
class WaveRow:
    """`concurrency` requests sent at once."""

    concurrency: int
    ttft_p50_s: float
    ttft_max_s: float
    wall_s: float
    completion_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s


def question(file_ids: list[str], suffix: str = "") -> list[dict]:
    """The offline demo's interleaved question (`interleaved_prompt`) as OpenAI content parts,
    the images as cached files; `suffix` is appended to the closing text."""
    from mpic.samples import interleaved_prompt

    content = [
        {"type": "text", "text": p}
        if isinstance(p, str)
        else {"type": "file", "file": {"file_id": p.entry_id}}
        for p in interleaved_prompt(file_ids)
    ]
    content[-1] = {"type": "text", "text": content[-1]["text"] + suffix}
    return content


async def ask(
    http: httpx.AsyncClient, content: list[dict], policy: str, max_tokens: int
) -> DemoRow:
    """One streamed chat; TTFT = the first content chunk."""
    body = streaming_chat_body(content, policy, max_tokens)
    answer = StreamedAnswer()
    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{policy}: HTTP {resp.status_code} {(await resp.aread()).decode()}")
        async for line in resp.aiter_lines():
            answer.feed(line)
    return DemoRow(
        policy,
        answer.text,
        answer.ttft_s,
        answer.prompt_tokens,
        answer.cached_tokens,
        answer.completion_tokens,
        time.perf_counter() - answer.t0,
    )


async def _upload(http: httpx.AsyncClient) -> list[str]:
    from mpic.samples import synthetic_png

    ids = []
    for i in range(3):  # the offline demo's three images
        resp = await http.post(
            "/v1/files",
            files={"file": (f"trip-{i}.png", synthetic_png(i), "image/png")},
            data={"purpose": "vision", "ttl_seconds": "3600"},
        )
        resp.raise_for_status()
        ids.append(resp.json()["id"])
    return ids


async def wave(
    http: httpx.AsyncClient, ids: list[str], concurrency: int, policy: str, max_tokens: int
) -> WaveRow:
    """`concurrency` different questions (own closing sentence each) sent at once."""
    t0 = time.perf_counter()
    rows = await asyncio.gather(
        *[
            ask(http, question(ids, f" (traveller {i + 1})"), policy, max_tokens)
            for i in range(concurrency)
        ]
    )
    wall = time.perf_counter() - t0
    ttfts = [r.ttft_s for r in rows]
    tokens = sum(r.completion_tokens for r in rows)
    return WaveRow(concurrency, statistics.median(ttfts), max(ttfts), wall, tokens)


async def _run(
    url: str, key: str, policies: list[str], max_tokens: int, concurrency: list[int]
) -> tuple[list[DemoRow], list[WaveRow]]:
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=600
    ) as http:
        ids = await _upload(http)
        await ask(http, question(ids), policies[0], 1)  # warm-up: first-request costs
        rows = [await ask(http, question(ids), p, max_tokens) for p in policies]
        waves = [await wave(http, ids, c, "mpic-32", max_tokens) for c in concurrency]
        return rows, waves


def run_demo(
    url: str,
    key: str,
    policies: list[str],
    max_tokens: int,
    concurrency: tuple[int, ...] | list[int] = (),
) -> list[DemoRow] | tuple[list[DemoRow], list[WaveRow]]:
    """Upload the three images and ask with every policy (one warm-up request first); with
    `concurrency`, also the waves, returned as `(rows, waves)`."""
    rows, waves = asyncio.run(_run(url, key, policies, max_tokens, list(concurrency)))
    return (rows, waves) if concurrency else rows


def print_rows(rows: list[DemoRow], engine: str = "", model: str = "") -> None:
    """A rich table: policy, TTFT, speed-up over `full`, linked tokens, answer."""
    from rich.console import Console
    from rich.table import Table

    base = next((r.ttft_s for r in rows if r.policy == "full"), None)
    title = "MPIC demo over HTTP (one interleaved question, three cached images)"
    title += f", engine: {engine}" if engine else ""
    table = Table(title=title + (f", model: {model}" if model else ""))
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


def print_waves(waves: list[WaveRow]) -> None:
    """A rich table of the concurrency waves (see the module docstring for `vs serial`)."""
    from rich.console import Console
    from rich.table import Table

    single = next((w.wall_s for w in waves if w.concurrency == 1), None)
    table = Table(title="Requests in flight together (mpic-32, different questions)")
    for col in ["concurrent", "TTFT p50 ms", "TTFT max ms", "wall s", "out tok/s", "vs serial"]:
        table.add_column(col)
    for w in waves:
        serial = f"{w.wall_s / (w.concurrency * single):.2f}" if single else "-"
        table.add_row(
            str(w.concurrency),
            f"{w.ttft_p50_s * 1e3:.0f}",
            f"{w.ttft_max_s * 1e3:.0f}",
            f"{w.wall_s:.2f}",
            f"{w.tokens_per_s:.1f}",
            serial,
        )
    Console().print(table)


def http_demo(
    url: str = "http://127.0.0.1:8000",
    key: str = "mpic-dev-alice",
    policies: str = DEFAULT_POLICIES,
    max_tokens: int = 8,
    concurrency: str = DEFAULT_CONCURRENCY,
    answer_policies: str = ANSWER_POLICIES,
    model: Path | None = None,
    label: str = "",
    repeats: int = 3,
) -> None:
    """Start the embedded server if none answers at `url` (on `model`, default: the embedded
    default's), run the demo, print the tables. `label` names the model in the titles;
    `repeats`: timed requests per policy of the answer table (median TTFT)."""
    from mpic.cli.demo_answers import http_answers, print_answers
    from mpic.deployments.config import load_config
    from mpic.deployments.local import is_serving, start_local, stop_local
    from mpic.model_spec import ModelSpec

    started = not is_serving(url)
    engine = ""
    if started:
        port = httpx.URL(url).port or 8000
        cfg = load_config(None)
        if model is not None:
            cfg = cfg.model_copy(
                update={"engine": cfg.engine.model_copy(update={"model": str(model)})}
            )
        engine = cfg.engine.kind
        typer.echo(
            f"no server at {url}: starting the embedded default ({engine} worker, model "
            f"{cfg.engine.model}; first start ~1-2 min)"
        )
    label = label or ("the running server's model" if not started else "")
    try:
        if started:  # inside the try: a failed start (a replica that fails) is shut down too
            url = start_local(cfg, port=port, log_to_driver=False)
        with httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=600
        ) as http:
            answers = http_answers(
                http, [p for p in answer_policies.split(",") if p], repeats=repeats
            )
        print_answers(answers, label + (f", {engine} engine over HTTP" if engine else ""))
        if model is not None and not ModelSpec.from_pretrained(Path(model)).takes_images:
            typer.echo("no image table: the model takes no images")
            return
        levels = [int(c) for c in concurrency.split(",") if c]
        names = [p for p in policies.split(",") if p]
        try:
            rows, waves = asyncio.run(_run(url, key, names, max_tokens, levels))
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code != 400:
                raise
            typer.echo(f"no image table: the model takes no images ({exc.response.text})")
            return
        print_rows(rows, engine, label)
        if waves:
            print_waves(waves)
    finally:
        if started:
            stop_local()


def command(
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help="Server to use or start."),
    key: str = typer.Option("mpic-dev-alice", "--key", help="API key (dev key by default)."),
    policies: str = typer.Option(DEFAULT_POLICIES, "--policies"),
    max_tokens: int = typer.Option(8, "--max-tokens", min=1, max=256),
    concurrency: str = typer.Option(DEFAULT_CONCURRENCY, "--concurrency"),
    answer_policies: str = typer.Option(ANSWER_POLICIES, "--answer-policies"),
) -> None:
    """Start the server if none runs (the embedded default), ask for the code planted in four
    uploaded documents, then upload three images, ask, print answer + TTFT per policy, then the
    concurrency waves."""
    http_demo(url, key, policies, max_tokens, concurrency, answer_policies)


if __name__ == "__main__":
    typer.run(command)
