"""`mpic bench online` (CLI process; vLLM's engine core and worker in child processes): the MPIC
workload served online on one vLLM engine, against vLLM's own automatic prefix caching and full
recomputation (issue 22 item 6; MPIC paper section 6, online serving).

Workload: U users each upload K items (images for a LLaVA model, text documents for a text
model); each chat is from a random user and links `items` of that user's items in a random order,
with text of random length before, between and after them (the items sit at varying positions),
then a question. Requests arrive as a Poisson process at each offered rate; every answer is
`max_tokens` tokens (`ignore_eos`). Every system sees the same chats at the same arrival times:

- `mpic-32` and the server's default policy (`ServeAppConfig.default_policy`): linked requests
  (the items' entries from the store, MPIC's selective prefill in vLLM's worker);
- `prefix`: the exact prompt with its images / document tokens, vLLM's automatic prefix caching on
  (it reuses only the common prefix: an item reused at another position misses);
- `full`: the exact prompt with a unique cache salt (no prefix-cache hit).

All run on the same vLLM engine (same settings, float32 on CPU; the prefix cache is reset between
runs), driven in-process through `AsyncVllmEngine` (no HTTP: the engine is what is compared).
Per system and rate: TTFT p50/p99 (submission to first token) and throughput (answers per second
over the run); a system stops at the first rate whose p99 passes 4x its unloaded TTFT. Saturation
throughput: the highest offered rate whose p99 TTFT stays under 2x the system's unloaded TTFT
(p50 of sequential requests); the MPIC systems and prefix caching are also measured at half of
prefix caching's saturation rate. Written: a table, JSON and a PNG.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import typer

from mpic.benchmarks.linking_load import png

WORDS = (
    "river stone harbor signal lantern orchard meadow copper violet engine window ledger canyon "
    "pillar thunder marble garden summit beacon ferry compass quarry velvet timber saddle"
).split()


@dataclass
class ChatSpec:
    """One chat: a user and its parts (text, or the index of one of the user's items)."""

    user: int
    parts: list[str | int]


def make_chats(n: int, users: int, per_user: int, items: int, seed: int) -> list[ChatSpec]:
    """`n` chats; items of the chat's user at varying positions among random text."""
    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    chats = []
    for _ in range(n):
        user = rng.randrange(users)
        picked = rng.sample(range(per_user), items)
        parts: list[str | int] = []
        if rng.random() < 0.7:
            parts.append(text(1, 24))
        for i in picked:
            parts.append(user * per_user + i)
            if rng.random() < 0.6:
                parts.append(text(1, 12))
        parts.append("Question: " + text(4, 12) + "?")
        chats.append(ChatSpec(user, parts))
    return chats


def document(seed: int, words: int = 160) -> str:
    """A seeded text document (sentences of common words)."""
    rng = random.Random(seed)
    out = []
    for _ in range(words // 10):
        out.append(" ".join(rng.choice(WORDS) for _ in range(10)).capitalize() + ".")
    return " ".join(out)


@dataclass
class RatePoint:
    """One system at one offered rate."""

    rate: float
    requests: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    throughput: float
    """Answers per second over the run (first arrival to last answer)."""


@dataclass
class SystemCurve:
    """One system's curve on one model."""

    system: str
    unloaded_ttft_ms: float
    points: list[RatePoint] = field(default_factory=list)

    def saturation(self, stat: str = "p99") -> float:
        """Highest offered rate whose p99 (or p50) TTFT < 2x unloaded TTFT (0 if none). With a
        dozen requests per rate the p99 is the slowest one: `p50` is the steadier reading."""
        key = "ttft_p99_ms" if stat == "p99" else "ttft_p50_ms"
        ok = [p.rate for p in self.points if getattr(p, key) < 2 * self.unloaded_ttft_ms]
        return max(ok, default=0.0)

    def at(self, rate: float) -> RatePoint | None:
        """The point measured at `rate` (None if none)."""
        return next((p for p in self.points if abs(p.rate - rate) < 1e-9), None)


class Workload:
    """The engine, the users' items and the requests of each system for a chat."""

    def __init__(self, engine: Any, kind: str, users: int, per_user: int, seed: int) -> None:
        self.engine, self.kind = engine, kind
        self.media: dict[str, bytes] = {}
        self.entries = []
        for u in range(users):
            for i in range(per_user):
                if kind == "image":
                    data = png(1000 * seed + 10 * u + i, side=64)
                    entry = engine.cache_image(data)
                    self.media[entry.entry_id] = data
                else:
                    entry = engine.cache_document(document(1000 * seed + 10 * u + i))
                self.entries.append(entry)
        self.table = {e.entry_id: e for e in self.entries}

    def _parts(self, chat: ChatSpec) -> list[Any]:
        from mpic.prompt_parts import DocumentRef, ImageRef

        ref = ImageRef if self.kind == "image" else DocumentRef
        return [p if isinstance(p, str) else ref(self.entries[p].entry_id) for p in chat.parts]

    def request(self, chat: ChatSpec, system: str, max_tokens: int) -> Any:
        """The engine request of `chat` under `system` (a policy, `prefix` or `full`)."""
        from mpic.engine.hf.vision import load_image
        from mpic.engine.vllm.requests import exact_request, linked_request
        from mpic.linker.recipe import plan_prompt

        eng = self.engine
        policy = "full" if system in ("prefix", "full") else system
        planned = plan_prompt(eng.spec, eng.processor, self._parts(chat), self.table, policy,
                              None, max_tokens)  # fmt: skip
        if policy != "full":
            req = linked_request(planned.plan, policy, eng.spec)
            req.cache_salt = f"online-{uuid.uuid4().hex}"  # linked KV: no cross-run hits
            return req
        images = [load_image(self.media[r]) for r in planned.refs if r in self.media]
        req = exact_request(planned.plan, eng.spec.image_token_id, images)
        if system == "full":
            req.cache_salt = f"full-{uuid.uuid4().hex}"
        return req


async def _reset_prefix_cache(engine: Any) -> None:
    """vLLM's prefix cache emptied (on the engine's own event loop, from any other loop)."""
    await asyncio.to_thread(engine._call, engine.llm.reset_prefix_cache())


async def _ttft(engine: Any, req: Any, max_tokens: int) -> tuple[float, float]:
    """(seconds to the first token, seconds to the last) of one request."""
    t0 = time.perf_counter()
    first = None
    async for res in engine.stream(req, max_tokens, {"ignore_eos": True}):
        if first is None and res.token_ids:
            first = time.perf_counter() - t0
    return (first if first is not None else time.perf_counter() - t0), time.perf_counter() - t0


def run_rate(
    work: Workload,
    system: str,
    chats: list[ChatSpec],
    rate: float,
    max_tokens: int,
    seed: int,
) -> RatePoint:
    """The chats as Poisson arrivals at `rate` per second; TTFT percentiles and throughput."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, len(chats)))
    reqs = [work.request(c, system, max_tokens) for c in chats]

    async def run() -> tuple[list[float], float]:
        await _reset_prefix_cache(work.engine)
        t0 = time.perf_counter()

        async def one(at: float, req: Any) -> tuple[float, float]:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            ttft, total = await _ttft(work.engine, req, max_tokens)
            return ttft, at + total

        out = await asyncio.gather(*(one(a, r) for a, r in zip(arrivals, reqs, strict=True)))
        return [t for t, _ in out], max(end for _, end in out) - float(arrivals[0])

    ttfts, span = asyncio.run(run())
    return RatePoint(
        rate=rate,
        requests=len(chats),
        ttft_p50_ms=1e3 * float(np.percentile(ttfts, 50)),
        ttft_p99_ms=1e3 * float(np.percentile(ttfts, 99)),
        throughput=len(chats) / span,
    )


def unloaded(work: Workload, system: str, chats: list[ChatSpec], max_tokens: int) -> float:
    """p50 TTFT (ms) of `chats` sent one after the other."""

    async def run() -> list[float]:
        await _reset_prefix_cache(work.engine)
        return [(await _ttft(work.engine, work.request(c, system, max_tokens), max_tokens))[0]
                for c in chats]  # fmt: skip

    return 1e3 * float(np.median(asyncio.run(run())))


def run_model(
    model: str,
    kind: str,
    systems: list[str],
    rates: list[float],
    requests: int,
    items: int,
    users: int,
    per_user: int,
    max_tokens: int,
    seed: int,
) -> list[SystemCurve]:
    """Every system's curve on one model (one engine)."""
    import tempfile

    from mpic.engine.vllm.async_engine import AsyncVllmEngine
    from mpic.engine.vllm.config import VllmEngineConfig
    from mpic.storage.config import StorageConfig

    storage = StorageConfig(url=Path(tempfile.mkdtemp()).as_uri(), fsync=False)
    engine = AsyncVllmEngine(VllmEngineConfig(model=model, storage=storage, max_num_seqs=16))
    curves = []
    try:
        work = Workload(engine, kind, users, per_user, seed)
        warm = make_chats(3, users, per_user, items, seed + 99)
        for system in systems:  # first-use costs out of the way
            unloaded(work, system, warm[:1], max_tokens)
        for system in systems:
            curve = SystemCurve(system, unloaded(work, system, warm, max_tokens))
            for r, rate in enumerate(rates):
                n = max(requests, int(rate * 6))
                chats = make_chats(n, users, per_user, items, seed + r)
                point = run_rate(work, system, chats, rate, max_tokens, seed + r)
                curve.points.append(point)
                typer.echo(
                    f"  {system:>9} rate {rate:5.2f}/s: TTFT p50 {point.ttft_p50_ms:7.0f} "
                    f"p99 {point.ttft_p99_ms:7.0f} ms, {point.throughput:5.2f} answers/s"
                )
                if point.ttft_p99_ms > 4 * curve.unloaded_ttft_ms:
                    break  # saturated: higher rates only queue longer
            curves.append(curve)
        prefix = next((c for c in curves if c.system == "prefix"), None)
        half = (prefix.saturation() or prefix.saturation("p50")) / 2 if prefix else 0.0
        for curve in curves if half > 0 else []:  # the point the issue asks for, measured
            if curve.system == "full" or any(abs(p.rate - half) < 1e-9 for p in curve.points):
                continue
            chats = make_chats(max(requests, int(half * 6)), users, per_user, items, seed + 50)
            curve.points.append(run_rate(work, curve.system, chats, half, max_tokens, seed + 50))
            curve.points.sort(key=lambda p: p.rate)
    finally:
        engine.close()
    return curves


def summary(curves: list[SystemCurve]) -> dict[str, Any]:
    """Saturation throughput of each system, MPIC's ratio to vLLM prefix caching, and p99 TTFT
    at half of prefix caching's saturation rate."""
    by = {c.system: c for c in curves}
    out: dict[str, Any] = {
        "saturation_rate": {c.system: c.saturation() for c in curves},
        "saturation_rate_p50": {c.system: c.saturation("p50") for c in curves},
    }
    prefix = by.get("prefix")
    if prefix is not None and prefix.saturation("p50"):
        base = prefix.saturation("p50")
        out["ratio_vs_prefix_p50"] = {
            c.system: c.saturation("p50") / base
            for c in curves
            if c.system not in ("prefix", "full")
        }
    if prefix is not None:
        base = prefix.saturation()
        out["ratio_vs_prefix"] = {
            c.system: (c.saturation() / base if base else float("inf"))
            for c in curves
            if c.system not in ("prefix", "full")
        }
        half = (base or prefix.saturation("p50")) / 2  # the p50 reading when p99 never held
        out["half_prefix_rate"] = half
        out["p99_at_half_prefix_rate_ms"] = {
            c.system: (p.ttft_p99_ms if (p := c.at(half)) else None) for c in curves
        }
    return out


def write_outputs(results: dict[str, list[SystemCurve]], meta: dict, out: Path) -> None:
    """`online.json` and `online.png` (per model: TTFT p50/p99 and throughput vs rate)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "meta": meta,
        "models": {
            m: {"curves": [asdict(c) for c in curves], "summary": summary(curves)}
            for m, curves in results.items()
        },
    }
    (out / "online.json").write_text(json.dumps(payload, indent=1))
    fig, axes = plt.subplots(len(results), 2, figsize=(11, 4 * len(results)), squeeze=False)
    for row, (m, curves) in enumerate(results.items()):
        ax_t, ax_x = axes[row]
        for c in curves:
            rates = [p.rate for p in c.points]
            line = ax_t.plot(
                rates, [p.ttft_p50_ms for p in c.points], "o-", label=f"{c.system} p50"
            )
            ax_t.plot(rates, [p.ttft_p99_ms for p in c.points], "x--", color=line[0].get_color(),
                      label=f"{c.system} p99")  # fmt: skip
            ax_x.plot(rates, [p.throughput for p in c.points], "o-", label=c.system)
        ax_t.set_xscale("log")
        ax_t.set_yscale("log")
        ax_t.set_xlabel("offered rate (requests/s)")
        ax_t.set_ylabel("TTFT (ms)")
        ax_t.set_title(m)
        ax_t.legend(fontsize=7)
        ax_x.set_xscale("log")
        ax_x.set_xlabel("offered rate (requests/s)")
        ax_x.set_ylabel("throughput (answers/s)")
        ax_x.set_title(f"{m}: saturation {summary(curves)['saturation_rate']}", fontsize=8)
        ax_x.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "online.png", dpi=110)
    plt.close(fig)


def print_table(results: dict[str, list[SystemCurve]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Online serving on one vLLM engine (CPU, float32)")
    for col in ["model", "system", "unloaded TTFT ms", "saturation req/s", "points"]:
        table.add_column(col)
    for m, curves in results.items():
        for c in curves:
            pts = "; ".join(
                f"{p.rate:g}/s: {p.ttft_p50_ms:.0f}/{p.ttft_p99_ms:.0f} ms {p.throughput:.2f}/s"
                for p in c.points
            )
            table.add_row(m, c.system, f"{c.unloaded_ttft_ms:.0f}", f"{c.saturation():g}", pts)
    Console().print(table)
    for m, curves in results.items():
        Console().print(m, json.dumps(summary(curves)))


def _smollm2_dir() -> str:
    from mpic.config import MPICHome
    from mpic.engine.tiny.smollm2 import import_smollm2

    for path in (Path(".mpic/fixtures/smollm2"), MPICHome().models_dir / "smollm2"):
        if (path / "config.json").is_file():
            return str(path)
    return str(import_smollm2(MPICHome().models_dir / "smollm2"))


def command(
    models: str = typer.Option(
        "llava,smollm2",
        "--models",
        help="llava (3 images per chat), smollm2 (4 documents per chat)",
    ),  # fmt: skip
    rates: str = typer.Option("0.5,1,2,4,8", "--rates", help="Offered rates (requests/s)."),
    requests: int = typer.Option(12, "--requests", min=2, max=1000, help="Chats per rate."),
    systems: str = typer.Option("mpic-32,default,prefix,full", "--systems"),
    max_tokens: int = typer.Option(4, "--max-tokens", min=1, max=256),
    users: int = typer.Option(4, "--users", min=1, max=64),
    seed: int = typer.Option(0, "--seed"),
    out: str = typer.Option("out/online", "--out", help="Folder for online.json / online.png."),
) -> None:
    """MPIC vs vLLM prefix caching vs full recomputation, online, on one vLLM engine."""
    from mpic.deployments.config import ServeAppConfig
    from mpic.deployments.local import prepare_local

    default = ServeAppConfig().default_policy
    names = []
    for s in systems.split(","):
        s = default if s == "default" else s
        if s and s not in names:
            names.append(s)
    rate_list = sorted(float(r) for r in rates.split(",") if r)
    setups = {
        "llava": lambda: (prepare_local(ServeAppConfig()).engine.model, "image", 3, 4),
        "smollm2": lambda: (_smollm2_dir(), "text", 4, 5),
    }
    results: dict[str, list[SystemCurve]] = {}
    for m in [m for m in models.split(",") if m]:
        if m not in setups:
            raise typer.BadParameter(f"unknown model {m!r}; expected {sorted(setups)}")
        model, kind, items, per_user = setups[m]()
        typer.echo(f"{m}: {model} ({items} {kind} items per chat; systems {names})")
        results[m] = run_model(model, kind, names, rate_list, requests, items, users, per_user,
                               max_tokens, seed)  # fmt: skip
    meta = {"rates": rate_list, "requests": requests, "max_tokens": max_tokens, "users": users,
            "default_policy": default, "seed": seed}  # fmt: skip
    print_table(results)
    write_outputs(results, meta, Path(out))
