"""`mpic bench online --closed-loop` (CLI process): the online workload of `mpic bench online`
(`mpic.benchmarks.online.workload`: the same users, items, chats, engine and systems) replayed
by a fixed number of concurrent clients instead of Poisson arrivals (issue 33 item 3).

Per model, one vLLM engine (`workload.engine_session`); per client level (`--clients`,
default 1, 2, 4, 8, 16) and system, after one warm-up request per system at the start, one
untimed round of N chats sent together (first-use costs at that batch size out of the way: a run
without it had 6-23 s first rounds on some levels, normal chats after, cause not established;
the round's TTFTs are kept as `warmup_ttfts_ms`) and vLLM's prefix cache reset: N clients start
together, and each sends its next chat as soon as its previous answer is complete, until
`--duration-s` (default 30) has passed since the start; the chats sent by then all finish (none
is cut off). The chats come from one seeded stream per level (`workload.chat_stream`),
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
- TTFT p50 / p95 / p99 over the level's chats (`workload.percentiles_ms`);
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

This module runs the levels; the levels, curves, summary and outputs are
`mpic.benchmarks.online.closed_results`.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer

from mpic.benchmarks.online import workload as wl
from mpic.benchmarks.online.closed_results import (
    ClosedCurve,
    Level,
    level_of,
    load_results,
    print_table,
    write_outputs,
)

DEFAULT_TTFT_BOUND_S = 1.0
"""A chat's first token is its user's first feedback; ~1 s is the limit for keeping the user's
flow of thought (Nielsen's response-time limits: 0.1 s instant, 1 s flow, 10 s attention)."""


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
    engine_options: dict[str, Any] = field(default_factory=dict)
    """`VllmOptions` fields that differ from their defaults (`--dtype`)."""


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
    with wl.engine_session(
        name, model, kind, run.users, run.per_user, run.seed, **run.engine_options
    ) as work:
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
    engine_options: dict[str, Any] | None = None,
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
        run = ClosedSettings(clients, duration_s, items, users, per_user, max_tokens, seed,
                             dict(engine_options or {}))  # fmt: skip

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
