"""`mpic bench online` (CLI process; vLLM's engine core and worker in child processes): the MPIC
workload served online on one vLLM engine, against vLLM's own automatic prefix caching and full
recomputation (issue 22 item 6; MPIC paper section 6, online serving).

Workload: U users each upload K items (images for a LLaVA model, text documents for a text
model); each chat is from a random user and links `items` of that user's items in a random order,
with text of random length before, between and after them (the items sit at varying positions),
then a question. Requests arrive as a Poisson process at each offered rate; every answer is
`max_tokens` tokens (`ignore_eos`). Every system sees the same chats at the same arrival times
(one seed per rate), and every request is built by `VllmFrontEnd.prepare`, the one place a
prompt becomes a vLLM request (the server's own path):

- `mpic-32` and the server's default policy (`ServeAppConfig.default_policy`, `auto`, with the
  model's own scout scales): linked requests (the items' entries from the store, MPIC's selective
  prefill in vLLM's worker; a fresh cache salt each, so no linked KV is reused across runs);
- `prefix`: `prepare(..., exact=True)`, the exact prompt with its images / document tokens and no
  salt, vLLM's automatic prefix caching on (it reuses only a common prefix: an item reused at
  another position misses);
- `full`: the same exact request with a fresh cache salt (no prefix-cache hit).

All run on the same vLLM engine (same settings: float32 unless `--dtype` says otherwise; the
prefix cache is reset before every measurement), driven in-process through `AsyncVllmEngine` (no
HTTP: the engine is what is compared). The saturation measurement:

- unloaded TTFT: the median of `--unloaded` (default 10) requests sent one at a time, each
  after 1 s of an idle engine (as a request arrives at a low rate), after one warm-up request per
  system (first-use costs out of the way), so one contention spike on a shared host does not set
  a system's bound. The same requests sent back to back (engine busy, caches warm) are recorded
  beside it (`unloaded_hot_ms`): on the 2-core CPU host those were faster than isolated arrivals;
- per system and offered rate, `--requests` (default 40) chats: TTFT p50 / p95 / p99 (submission
  to first token, numpy's linear interpolation) and throughput (answers per second, first arrival
  to last answer). With 40 requests p99 sits between the two slowest (0.61 of the way to the
  slowest) and p95 between the third and second slowest: p95 is printed beside p99 as the reading
  one request cannot move on its own;
- rates: a grid fine near the knee (`--rates`, default 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4, 6, 8 per
  second), run upward; a system stops once it is past its bound (TTFT not under 2x its unloaded
  TTFT) for good: after a rate whose p50 is past it (most requests queue), or after two rates in
  a row whose p99 is (one Poisson burst, two or three arrivals within one prefill, doubles those
  requests' TTFT on a CPU host and can push one rate's p99 past the bound while the next rate
  holds; stopping at the first such rate read that burst as saturation);
- saturation (the issue's rule): the highest offered grid rate whose p99 TTFT stays under 2x the
  system's unloaded TTFT (0: none did; the ratio is then reported as a lower bound); the first
  grid rate past the bound is reported beside it, and the same rule on p95 and p50;
- `prefix` runs first; every MPIC system and `prefix` are then also measured at half of prefix
  caching's saturation rate (when not a grid rate), on one seed for all of them.

Written after every point (a run cut short keeps what it measured): `online.json` and
`online.png`; progress lines on stdout; a table at the end.

`--closed-loop` replays the same chats on the same engine and systems with N concurrent clients
instead (`mpic.benchmarks.online.closed`: throughput and TTFT per client count, capacity). What
both loops share (chats, items, the systems' requests, the engine session, a request's token
timing, the TTFT percentiles, the models) is `mpic.benchmarks.online.workload`; the open loop's
points, curves, saturation rule, summary and outputs are `mpic.benchmarks.online.results`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import typer

from mpic.benchmarks.online.results import (
    RatePoint,
    SystemCurve,
    load_results,
    print_table,
    write_outputs,
)
from mpic.benchmarks.online.workload import (
    MODELS,
    ChatSpec,
    Workload,
    engine_session,
    make_chats,
    model_setup,
    percentiles_ms,
    reset_prefix_cache,
    ttft,
    unloaded,
)


def run_rate(
    work: Workload,
    system: str,
    chats: list[ChatSpec],
    rate: float,
    max_tokens: int,
    seed: int,
    grid: bool = True,
) -> RatePoint:
    """The chats as Poisson arrivals at `rate` per second (arrival times from `seed`: the same
    for every system); TTFT percentiles and throughput. Requests are built before the clock
    starts."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, len(chats)))
    reqs = [work.request(c, system, max_tokens) for c in chats]

    async def run() -> tuple[list[float], float]:
        await reset_prefix_cache(work.engine)
        t0 = time.perf_counter()

        async def one(at: float, req: Any) -> tuple[float, float]:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            first, total = await ttft(work.engine, req, max_tokens)
            return first, at + total

        out = await asyncio.gather(*(one(a, r) for a, r in zip(arrivals, reqs, strict=True)))
        return [t for t, _ in out], max(end for _, end in out) - float(arrivals[0])

    ttfts, span = asyncio.run(run())
    pct = percentiles_ms(ttfts)
    raw = [round(1e3 * t, 1) for t in ttfts]
    return RatePoint(rate, len(chats), *pct, len(chats) / span, raw, grid)


@dataclass
class RunSettings:
    """How one model's curves are measured (see the module docstring)."""

    rates: list[float]
    requests: int
    unloaded: int
    items: int
    users: int
    per_user: int
    max_tokens: int
    seed: int
    engine_options: dict[str, Any] = field(default_factory=dict)
    """`VllmOptions` fields that differ from their defaults (`--dtype`)."""


def _echo(model: str, system: str, p: RatePoint, curve: SystemCurve) -> None:
    ok = "ok" if curve.holds(p) else "past 2x unloaded"
    typer.echo(
        f"[{time.strftime('%H:%M:%S')}] {model} {system:>12} {p.rate:5.3g}/s x{p.requests}: "
        f"TTFT p50 {p.ttft_p50_ms:6.0f} p95 {p.ttft_p95_ms:6.0f} p99 {p.ttft_p99_ms:6.0f} ms, "
        f"{p.throughput:5.2f} answers/s ({ok}{'' if p.grid else ', half-prefix point'})"
    )


def run_model(
    name: str,
    model: str,
    kind: str,
    systems: list[str],
    run: RunSettings,
    on_curve: Any = None,
) -> list[SystemCurve]:
    """Every system's curve on one model (one engine); `on_curve(curves)` after each point."""
    order = sorted(systems, key=lambda s: s != "prefix")  # prefix first: its half rate
    curves: list[SystemCurve] = []
    half = 0.0
    with engine_session(
        name, model, kind, run.users, run.per_user, run.seed, **run.engine_options
    ) as work:
        engine = work.engine
        warm = make_chats(run.unloaded + 1, run.users, run.per_user, run.items, run.seed + 99)
        for system in order:
            unloaded(work, system, warm[:1], run.max_tokens)  # first-use costs out of the way
        for system in order:
            before = engine.fallbacks
            samples = unloaded(work, system, warm[1:], run.max_tokens, idle_s=1.0)
            hot = unloaded(work, system, warm[1:], run.max_tokens)
            curve = SystemCurve(system, float(np.median(samples)), samples, hot)
            typer.echo(
                f"[{time.strftime('%H:%M:%S')}] {name} {system:>12} unloaded TTFT "
                f"{curve.unloaded_ttft_ms:.0f} ms (median of {len(samples)}, "
                f"{min(samples):.0f}-{max(samples):.0f}; back to back {np.median(hot):.0f})"
            )
            for r, rate in enumerate(run.rates):
                n = max(run.requests, int(rate * 6))
                chats = make_chats(n, run.users, run.per_user, run.items, run.seed + r)
                point = run_rate(work, system, chats, rate, run.max_tokens, run.seed + r)
                curve.points.append(point)
                _echo(name, system, point, curve)
                if on_curve is not None:
                    on_curve([*curves, curve])  # a run cut short keeps every point
                if curve.stopped():
                    break  # past its bound for good: higher rates only queue longer
            if system == "prefix":
                half = curve.saturation() / 2
            if half > 0 and system != "full" and curve.at(half) is None:
                chats = make_chats(run.requests, run.users, run.per_user, run.items, run.seed + 50)
                point = run_rate(work, system, chats, half, run.max_tokens, run.seed + 50, False)
                curve.points.append(point)
                curve.points.sort(key=lambda p: p.rate)
                _echo(name, system, point, curve)
            curve.fallbacks = engine.fallbacks - before
            curves.append(curve)
            if on_curve is not None:
                on_curve(curves)
    return curves


def engine_options(dtype: str) -> dict[str, Any]:
    """`VllmOptions` overrides for `--dtype` (vLLM's names, as `mpic serve --dtype`; empty for
    the default dtype); BadParameter for a name vLLM does not take."""
    from mpic.engine.vllm.config import DTYPES, VllmOptions

    if dtype not in DTYPES:
        raise typer.BadParameter(f"--dtype {dtype!r}: choose from {', '.join(DTYPES)}")
    return {} if DTYPES[dtype] == VllmOptions().dtype else {"dtype": DTYPES[dtype]}


def command(
    models: str = typer.Option(
        "llava,smollm2",
        "--models",
        help="llava (3 images per chat), smollm2 (4 documents per chat), or a model folder",
    ),  # fmt: skip
    rates: str = typer.Option(
        "0.25,0.5,0.75,1,1.5,2,3,4,6,8", "--rates", help="Offered rates (requests/s), run upward."
    ),
    requests: int = typer.Option(40, "--requests", min=2, max=1000, help="Chats per rate."),
    unloaded_n: int = typer.Option(
        10,
        "--unloaded",
        min=1,
        max=200,
        help="Requests (one at a time, 1 s idle before each) for the unloaded TTFT.",
    ),
    systems: str = typer.Option("mpic-32,default,prefix,full", "--systems"),
    max_tokens: int = typer.Option(4, "--max-tokens", min=1, max=256),
    users: int = typer.Option(4, "--users", min=1, max=64),
    seed: int = typer.Option(0, "--seed"),
    out: str = typer.Option(
        "out/online",
        "--out",
        help="Folder for online.json / online.png (closed loop: "
        "online_closed.json / online_closed.png).",
    ),
    from_json: str = typer.Option(
        "",
        "--from-json",
        help="Only re-read an online.json (with --closed-loop: an online_closed.json): "
        "table, summary, JSON and PNG to --out.",
    ),
    closed_loop: bool = typer.Option(
        False,
        "--closed-loop",
        help="Closed loop instead of Poisson rates: N concurrent clients, each sending its "
        "next chat as soon as its answer is complete (--clients, --duration-s, --ttft-bound-s; "
        "--rates, --requests, --unloaded unused).",
    ),
    clients: str = typer.Option(
        "1,2,4,8,16", "--clients", help="Closed loop: concurrent clients per level."
    ),
    duration_s: float = typer.Option(
        30.0, "--duration-s", min=0.1, help="Closed loop: seconds each level sends chats."
    ),
    ttft_bound_s: float | None = typer.Option(
        None,
        "--ttft-bound-s",
        min=0.001,
        help="Closed loop: the p95 TTFT bound for 'most clients under the bound' (default 1 s; "
        "with --from-json, the run's own unless given).",
    ),
    dtype: str = typer.Option(
        "float32",
        "--dtype",
        help="The engine's weights dtype for every system: auto, half, float16, bfloat16, "
        "float, float32 (as mpic serve; auto: float32).",
    ),
) -> None:
    """MPIC vs vLLM prefix caching vs full recomputation, online, on one vLLM engine."""
    if closed_loop:
        from mpic.benchmarks.online import closed as online_closed
    if from_json:
        if closed_loop:
            online_closed.replay(Path(from_json), Path(out), ttft_bound_s)
            return
        results, meta = load_results(Path(from_json))
        print_table(results)
        write_outputs(results, meta, Path(out))
        return
    from mpic.deployments.config import ServeAppConfig
    from mpic.engine.vllm.config import DTYPES

    options = engine_options(dtype)
    dtype = DTYPES[dtype]  # the weights dtype the JSON records (vLLM's alias resolved)
    default = ServeAppConfig().default_policy
    names = []
    for s in systems.split(","):
        s = default if s == "default" else s
        if s and s not in names:
            names.append(s)
    model_list = [m for m in models.split(",") if m]
    for m in set(model_list) - set(MODELS):  # before any model runs
        model_setup(m)
    if closed_loop:
        levels = sorted({int(c) for c in clients.split(",") if c})
        if not levels or levels[0] < 1:
            raise typer.BadParameter(f"--clients needs positive counts, got {clients!r}")
        bound = online_closed.DEFAULT_TTFT_BOUND_S if ttft_bound_s is None else ttft_bound_s
        online_closed.command(model_list, names, levels, duration_s, bound, max_tokens, users,
                              seed, {"default_policy": default, "dtype": dtype}, Path(out),
                              options)  # fmt: skip
        return
    rate_list = sorted(float(r) for r in rates.split(",") if r)
    meta = {"rates": rate_list, "requests": requests, "unloaded": unloaded_n,
            "max_tokens": max_tokens, "users": users, "default_policy": default,
            "seed": seed, "dtype": dtype}  # fmt: skip
    results: dict[str, list[SystemCurve]] = {}
    for m in model_list:
        model, kind, items, per_user = model_setup(m)
        typer.echo(f"{m}: {model} ({items} {kind} items per chat; systems {names})")
        run = RunSettings(rate_list, requests, unloaded_n, items, users, per_user, max_tokens,
                          seed, options)  # fmt: skip

        def save(curves: list[SystemCurve], m: str = m) -> None:
            write_outputs({**results, m: curves}, meta, Path(out))

        results[m] = run_model(m, model, kind, names, run, on_curve=save)
    print_table(results)
    write_outputs(results, meta, Path(out))
