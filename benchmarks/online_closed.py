"""`mpic bench online --closed-loop` (CLI process): the online workload of `mpic bench online`
(`mpic.benchmarks.online_workload`: the same users, items, chats, engine and systems) replayed
by a fixed number of concurrent clients instead of Poisson arrivals (issue 33 item 3).

Per model, one vLLM engine (`online_workload.engine_session`); per client level (`--clients`,
default 1, 2, 4, 8, 16) and system, after one warm-up request per system at the start, one
untimed round of N chats sent together (first-use costs at that batch size out of the way: a run
without it had 6-23 s first rounds on some levels, normal chats after, cause not established;
the round's TTFTs are kept as `warmup_ttfts_ms`) and vLLM's prefix cache reset: N clients start
together, and each sends its next chat as soon as its previous answer is complete, until
`--duration-s` (default 30) has passed since the start; the chats sent by then all finish (none
is cut off). The chats come from one seeded stream per level (`online_workload.chat_stream`),
taken in order by whichever client is free: every system gets the same chats in the same order.
Levels run outer and systems inner, so a change of host load (a shared 2-core host) falls on
every system alike at a level.

A client builds its next request as the server would (`Workload.request`, i.e.
`VllmFrontEnd.prepare`) on one helper thread shared by the clients (one at a time: the
tokenizer is not shared across threads), then submits it; its build time is recorded
(`prepare_p50_ms`) and is not part of TTFT, which is timed from submission to the engine (as in
the open loop). Per level:

- throughput: chats sent / span and output tokens / span, the span from the start to the last
  answer (vLLM's own benchmark counts its duration the same way, to the last completion);
- TTFT p50 / p95 / p99 over the level's chats (`online_workload.percentiles_ms`);
- ITL: the gaps between successive streamed outputs of a chat after its first token (vLLM's CPU
  engine streams one token per step and request: these are inter-token latencies), p50 / p95 /
  p99 over all chats' gaps, and their mean; None when answers have one token;
- end-to-end latency p50, vLLM's fallbacks and the host's 1-minute load average after the level.

Per system: capacity, the best chats per second over the levels (and the level it came at);
and the most clients whose p95 TTFT stays under `--ttft-bound-s` (one absolute bound for every
system: 1 s by default, the limit for a user's flow of thought without feedback; the open loop's
rule, 2x each system's own unloaded TTFT, gives the faster system the tighter bound). Printed:
a rich table per level, a summary table, and capacity(system) / capacity(prefix). Written after
every level (a run cut short keeps what it measured): `online_closed.json` and
`online_closed.png` (throughput and p95 TTFT vs clients, one line per system).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import typer

from mpic.benchmarks import online_workload as wl

DEFAULT_TTFT_BOUND_S = 1.0
"""A chat's first token is its user's first feedback; ~1 s is the limit for keeping the user's
flow of thought (Nielsen's response-time limits: 0.1 s instant, 1 s flow, 10 s attention)."""


@dataclass
class Level:
    """One system at one number of concurrent clients."""

    clients: int
    chats: int
    span_s: float
    """From the start to the last answer (no chat is sent after `duration_s`)."""
    chats_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float | None
    itl_p95_ms: float | None
    itl_p99_ms: float | None
    itl_mean_ms: float | None
    latency_p50_ms: float
    """Submission to the last token."""
    prepare_p50_ms: float
    """Building a request (`VllmFrontEnd.prepare`), before submission: not in TTFT."""
    fallbacks: int = 0
    load_1m: float | None = None
    """The host's 1-minute load average after the level."""
    ttfts_ms: list[float] = field(default_factory=list)
    """Every chat's TTFT, in the order the chats were sent."""
    warmup_ttfts_ms: list[float] = field(default_factory=list)
    """TTFTs of the untimed round before the level (N chats sent together)."""


@dataclass
class ClosedCurve:
    """One system's levels on one model."""

    system: str
    levels: list[Level] = field(default_factory=list)

    def capacity(self) -> Level | None:
        """The level with the most chats per second (None: no level)."""
        return max(self.levels, key=lambda lv: lv.chats_per_s, default=None)

    def clients_under(self, bound_s: float, stat: str = "p95") -> int:
        """The most clients whose TTFT `stat` is under `bound_s` (0: at no level)."""
        ok = [lv.clients for lv in self.levels if getattr(lv, f"ttft_{stat}_ms") < 1e3 * bound_s]
        return max(ok, default=0)


def run_level(
    work: Any,
    system: str,
    chats: Iterator[wl.ChatSpec],
    clients: int,
    duration_s: float,
    max_tokens: int,
) -> Level:
    """`clients` concurrent clients, each sending `chats`' next chat as soon as its previous
    answer is complete, until `duration_s` has passed; the measured level."""
    builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpic-closed-prepare")
    fallbacks = getattr(work.engine, "fallbacks", 0)

    async def run() -> tuple[float, list[tuple[float, float, list[float]]]]:
        await wl.reset_prefix_cache(work.engine)
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        done: list[tuple[float, float, list[float]]] = []

        async def client() -> None:
            while time.perf_counter() < t0 + duration_s:
                b0 = time.perf_counter()
                chat = next(chats)
                req = await loop.run_in_executor(
                    builder, work.request, chat, system, max_tokens
                )  # fmt: skip
                sent, times = await wl.token_times(work.engine, req, max_tokens)
                done.append((sent - b0, sent, times))

        await asyncio.gather(*(client() for _ in range(clients)))
        return t0, done

    try:
        t0, done = asyncio.run(run())
    finally:
        builder.shutdown()
    return level_of(clients, t0, done, getattr(work.engine, "fallbacks", 0) - fallbacks)


def warm_round(
    work: Any, system: str, chats: Iterator[wl.ChatSpec], clients: int, max_tokens: int
) -> list[float]:
    """One untimed round before a level: `clients` chats sent together (their TTFTs, ms)."""

    async def run() -> list[tuple[float, list[float]]]:
        reqs = [work.request(next(chats), system, max_tokens) for _ in range(clients)]
        return await asyncio.gather(
            *(wl.token_times(work.engine, r, max_tokens) for r in reqs)
        )  # fmt: skip

    return [round(1e3 * (times[0] - sent), 1) for sent, times in asyncio.run(run()) if times]


def level_of(
    clients: int, t0: float, done: list[tuple[float, float, list[float]]], fallbacks: int = 0
) -> Level:
    """A level from its chats: (build seconds, submission time, token arrival times) each, in
    the order sent; `t0` the level's start."""
    ttfts = [times[0] - sent for _, sent, times in done]
    ends = [times[-1] for _, _, times in done]
    gaps = [g for _, _, times in done for g in np.diff(np.unique(times))]
    span = max(ends) - t0
    itl = wl.percentiles_ms(gaps) if gaps else [None] * 3
    return Level(
        clients=clients,
        chats=len(done),
        span_s=span,
        chats_per_s=len(done) / span,
        output_tokens_per_s=sum(len(times) for _, _, times in done) / span,
        ttft_p50_ms=(pct := wl.percentiles_ms(ttfts))[0],
        ttft_p95_ms=pct[1],
        ttft_p99_ms=pct[2],
        itl_p50_ms=itl[0],
        itl_p95_ms=itl[1],
        itl_p99_ms=itl[2],
        itl_mean_ms=1e3 * float(np.mean(gaps)) if gaps else None,
        latency_p50_ms=wl.percentiles_ms([t[-1] - s for _, s, t in done])[0],
        prepare_p50_ms=wl.percentiles_ms([b for b, _, _ in done])[0],
        fallbacks=fallbacks,
        ttfts_ms=[round(1e3 * t, 1) for t in ttfts],
    )


@dataclass
class ClosedSettings:
    """How one model's levels are measured (see the module docstring)."""

    clients: list[int]
    duration_s: float
    items: int
    users: int
    per_user: int
    max_tokens: int
    seed: int


def _echo(model: str, system: str, lv: Level) -> None:
    itl = "-" if lv.itl_p50_ms is None else f"{lv.itl_p50_ms:.0f}"
    typer.echo(
        f"[{time.strftime('%H:%M:%S')}] {model} {system:>12} x{lv.clients:<2} clients: "
        f"{lv.chats} chats in {lv.span_s:.1f} s, {lv.chats_per_s:.2f} chats/s, "
        f"{lv.output_tokens_per_s:.1f} tok/s, TTFT p50 {lv.ttft_p50_ms:.0f} p95 "
        f"{lv.ttft_p95_ms:.0f} p99 {lv.ttft_p99_ms:.0f} ms, ITL p50 {itl} ms, "
        f"load {lv.load_1m:.1f}"
    )


def run_model(
    name: str, model: str, kind: str, systems: list[str], run: ClosedSettings, on_curve: Any = None
) -> list[ClosedCurve]:
    """Every system's levels on one model (one engine); `on_curve(curves)` after each level."""
    curves = [ClosedCurve(s) for s in systems]
    with wl.engine_session(name, model, kind, run.users, run.per_user, run.seed) as work:
        warm = wl.make_chats(1, run.users, run.per_user, run.items, run.seed + 99)
        for system in systems:
            wl.unloaded(work, system, warm, run.max_tokens)  # first-use costs out of the way
        for i, clients in enumerate(run.clients):
            for curve in curves:  # the same chats, in the same order, for every system
                first = wl.chat_stream(run.users, run.per_user, run.items, run.seed + 1000)
                warm_ms = warm_round(work, curve.system, first, clients, run.max_tokens)
                chats = wl.chat_stream(run.users, run.per_user, run.items, run.seed + i)
                lv = run_level(work, curve.system, chats, clients, run.duration_s, run.max_tokens)
                lv.load_1m, lv.warmup_ttfts_ms = os.getloadavg()[0], warm_ms
                curve.levels.append(lv)
                _echo(name, curve.system, lv)
                if on_curve is not None:
                    on_curve(curves)
    return curves


def summary(curves: list[ClosedCurve], bound_s: float) -> dict[str, Any]:
    """Capacity per system (chats/s, the level it came at, output tokens/s there), its ratio to
    vLLM prefix caching's, and the most clients whose p95 (and p99) TTFT stays under `bound_s`."""
    caps = {c.system: c.capacity() for c in curves}
    out: dict[str, Any] = {
        "ttft_bound_s": bound_s,
        "capacity_chats_per_s": {s: lv.chats_per_s if lv else None for s, lv in caps.items()},
        "capacity_clients": {s: lv.clients if lv else None for s, lv in caps.items()},
        "capacity_output_tokens_per_s": {
            s: lv.output_tokens_per_s if lv else None for s, lv in caps.items()
        },
        "clients_under_bound_p95": {c.system: c.clients_under(bound_s) for c in curves},
        "clients_under_bound_p99": {c.system: c.clients_under(bound_s, "p99") for c in curves},
    }
    base = caps.get("prefix")
    if base is not None and base.chats_per_s > 0:
        out["capacity_ratio_vs_prefix"] = {
            s: lv.chats_per_s / base.chats_per_s for s, lv in caps.items() if lv and s != "prefix"
        }
    return out


def load_results(path: Path) -> tuple[dict[str, list[ClosedCurve]], dict]:
    """(curves per model, meta) of an `online_closed.json`."""
    doc = json.loads(path.read_text())
    results = {
        m: [
            ClosedCurve(c["system"], [Level(**lv) for lv in c["levels"]])
            for c in v["curves"]
        ]
        for m, v in doc["models"].items()
    }  # fmt: skip
    return results, doc["meta"]


def write_outputs(results: dict[str, list[ClosedCurve]], meta: dict, out: Path) -> None:
    """`online_closed.json` and `online_closed.png` (per model: chats/s and p95 TTFT vs
    clients, one line per system; the TTFT bound dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    bound_s = meta["ttft_bound_s"]
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "meta": meta,
        "models": {
            m: {"curves": [asdict(c) for c in curves], "summary": summary(curves, bound_s)}
            for m, curves in results.items()
        },
    }
    (out / "online_closed.json").write_text(json.dumps(payload, indent=1))
    fig, axes = plt.subplots(len(results), 2, figsize=(12, 4.5 * len(results)), squeeze=False)
    for row, (m, curves) in enumerate(results.items()):
        ax_x, ax_t = axes[row]
        for c in curves:
            n = [lv.clients for lv in c.levels]
            ax_x.plot(n, [lv.chats_per_s for lv in c.levels], "o-", label=c.system)
            ax_t.plot(n, [lv.ttft_p95_ms for lv in c.levels], "o-", label=c.system)
        ax_t.axhline(1e3 * bound_s, color="gray", linestyle=":", linewidth=1,
                     label=f"bound {bound_s:g} s")  # fmt: skip
        ax_x.set_ylabel("throughput (chats/s)")
        ax_x.set_title(f"{m}: throughput vs concurrent clients", fontsize=9)
        ax_t.set_yscale("log")
        ax_t.set_ylabel("TTFT p95 (ms)")
        ax_t.set_title(f"{m}: p95 TTFT vs concurrent clients", fontsize=9)
        ticks = sorted({lv.clients for c in curves for lv in c.levels})
        for ax in (ax_x, ax_t):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent clients")
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "online_closed.png", dpi=110)
    plt.close(fig)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def print_table(results: dict[str, list[ClosedCurve]], bound_s: float) -> None:
    """Every level, then per system: capacity, its ratio to prefix caching's, clients under the
    bound."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="Closed loop on one vLLM engine: N clients, each sends on its answer")
    cols = ["model", "system", "clients", "chats", "chats/s", "out tok/s",
            "TTFT p50 / p95 / p99 ms", "ITL p50 / p99 ms"]  # fmt: skip
    for col in cols:
        table.add_column(col, justify="left" if col in ("model", "system") else "right")
    for m, curves in results.items():
        for c in curves:
            for lv in c.levels:
                table.add_row(
                    m, c.system, str(lv.clients), str(lv.chats), f"{lv.chats_per_s:.2f}",
                    f"{lv.output_tokens_per_s:.1f}",
                    f"{lv.ttft_p50_ms:.0f} / {lv.ttft_p95_ms:.0f} / {lv.ttft_p99_ms:.0f}",
                    f"{_ms(lv.itl_p50_ms)} / {_ms(lv.itl_p99_ms)}",
                )  # fmt: skip
    console.print(table)
    caps = Table(title=f"Capacity and clients with p95 TTFT < {bound_s:g} s")
    for col in ["model", "system", "capacity chats/s (clients)", "out tok/s there",
                "/ prefix", f"clients p95 < {bound_s:g} s", "p99 <"]:  # fmt: skip
        caps.add_column(col)
    for m, curves in results.items():
        s = summary(curves, bound_s)
        ratio = s.get("capacity_ratio_vs_prefix", {})
        for c in curves:
            lv = c.capacity()
            if lv is None:
                continue
            r = ratio.get(c.system)
            caps.add_row(
                m, c.system, f"{lv.chats_per_s:.2f} ({lv.clients})",
                f"{lv.output_tokens_per_s:.1f}", "1" if c.system == "prefix" else
                ("-" if r is None else f"{r:.2f}"),
                str(c.clients_under(bound_s)), str(c.clients_under(bound_s, "p99")),
            )  # fmt: skip
    console.print(caps)
    for m, curves in results.items():
        ratio = summary(curves, bound_s).get("capacity_ratio_vs_prefix")
        text = ", ".join(f"{k} {v:.2f}" for k, v in ratio.items()) if ratio else "no prefix"
        console.print(f"{m}: capacity(system) / capacity(prefix): {text}")


def command(
    models: list[str],
    systems: list[str],
    clients: list[int],
    duration_s: float,
    bound_s: float,
    max_tokens: int,
    users: int,
    seed: int,
    meta: dict,
    out: Path,
) -> None:
    """The closed-loop run of `mpic bench online --closed-loop` (options checked there)."""
    meta = {**meta, "mode": "closed-loop", "clients": clients, "duration_s": duration_s,
            "ttft_bound_s": bound_s, "max_tokens": max_tokens, "users": users, "seed": seed,
            "systems": systems, "load_1m_at_start": os.getloadavg()[0]}  # fmt: skip
    results: dict[str, list[ClosedCurve]] = {}
    for m in models:
        model, kind, items, per_user = wl.model_setup(m)
        typer.echo(f"{m}: {model} ({items} {kind} items per chat; systems {systems}; "
                   f"clients {clients}, {duration_s:g} s each)")  # fmt: skip
        run = ClosedSettings(clients, duration_s, items, users, per_user, max_tokens, seed)

        def save(curves: list[ClosedCurve], m: str = m) -> None:
            write_outputs({**results, m: curves}, meta, out)

        results[m] = run_model(m, model, kind, systems, run, on_curve=save)
    print_table(results, bound_s)
    write_outputs(results, meta, out)


def replay(path: Path, out: Path, bound_s: float | None = None) -> None:
    """Re-read an `online_closed.json`: tables, JSON and PNG to `out` (under another TTFT
    bound when given)."""
    results, meta = load_results(path)
    if bound_s is not None:
        meta = {**meta, "ttft_bound_s": bound_s}
    print_table(results, meta["ttft_bound_s"])
    write_outputs(results, meta, out)
