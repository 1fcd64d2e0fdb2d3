"""`mpic bench linking` (CLI process; vLLM's engine core and worker in child processes): what
linking costs the requests around it on the vLLM worker (issue 22 items 2 and 3).

- Head-of-line: D requests decode (streamed, `ignore_eos`), then M new linked requests arrive
  whose entries live only in an object store that answers every GET `delay_s` late
  (`mpic.benchmarks.delayed_s3`; the worker's memory tier is 0 bytes, so every entry is a GET).
  The decoders' inter-token latency (ITL) while the new requests load and link is compared with
  their ITL in the same run before the arrivals (unloaded), for the connector's load modes
  (`async_loads`): True, reads and linking in the background (the linking thread); "reads",
  reads in the background (vLLM's WAITING_FOR_REMOTE_KVS), linking inside a step; False, both
  inside the step. `link_share` paces the linking thread while requests decode. The window is
  split with the worker's spans (`read_spans`, `link_spans`): gaps while an entry read is in
  flight and no link runs (what the loads cost the step) and gaps that overlap a link pass (what
  the recomputation costs). `exact=True` sends the same new prompts as plain vLLM requests with
  their images (no linking: vLLM's own prefill of them), the cost any prefill of new requests
  puts on the decoders.
- Batching: B linked requests (entries in the worker's memory tier) arrive together; their TTFT
  with the step's requests linked in one selective pass (`batch_links`) vs one pass per request,
  and the connector's counters (`largest_pass`).

Both run on the small random LLaVA of `mpic demo` (or `--model`), float32 on CPU.
"""

from __future__ import annotations

import asyncio
import io
import json
import statistics
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import typer


def png(seed: int, side: int = 48) -> bytes:
    """A seeded random RGB PNG."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _engine(model: str, storage: Any, **options: Any) -> Any:
    from mpic.engine.vllm.async_engine import AsyncVllmEngine
    from mpic.engine.vllm.config import VllmEngineConfig

    cfg = VllmEngineConfig(model=model, storage=storage, **options)
    return AsyncVllmEngine(cfg)


def _linked(
    engine: Any,
    entries: list[Any],
    text: str,
    policy: str = "mpic-32",
    media: dict[str, bytes] | None = None,
) -> Any:
    """The linked request of text, image 1, 'and', image 2, ... (`policy` depths;
    `VllmFrontEnd.prepare`), salted: no prefix-cache hit between requests. With `media` (entry
    id -> image bytes): the same prompt as a plain vLLM request with its images instead."""
    from mpic.linker.prompt import ImageRef

    parts: list[Any] = [f"{text} ({uuid.uuid4().hex[:6]})"]
    for e in entries:
        parts += [ImageRef(e.entry_id), "and"]
    table = {e.entry_id: e for e in entries}
    salt = f"bench-{uuid.uuid4().hex}"
    exact = media is not None
    return engine.prepare(parts, table, policy, None, 16, media=media, exact=exact, salt=salt)[1]


async def _stream(engine: Any, req: Any, max_tokens: int, times: list[float]) -> None:
    """Decode `req`, appending the arrival time of every token to `times`."""
    seen = 0
    async for res in engine.stream(req, max_tokens, {"ignore_eos": True}):
        now = time.perf_counter()
        times.extend([now] * (len(res.token_ids) - seen))
        seen = len(res.token_ids)


@dataclass
class HeadOfLine:
    """One head-of-line run."""

    async_loads: bool | str
    exact: bool
    """The new requests were plain vLLM requests (no linking)."""
    delay_s: float
    link_share: float
    itl_unloaded_ms: float
    """Mean gap between the decoders' tokens before the new requests arrived."""
    itl_loading_ms: float
    """Mean gap while the new requests' entries load and link (arrival -> last first token)."""
    itl_max_loading_ms: float
    ratio: float
    itl_reads_ms: float
    """Mean gap overlapping an entry read and no link pass (nan: no such gap)."""
    itl_reads_max_ms: float
    reads_gaps: int
    reads_ratio: float
    itl_linking_ms: float
    """Mean gap overlapping a link pass (in a step or on the linking thread)."""
    new_ttft_ms: list[float]
    gets: int
    worker: dict[str, Any] = field(default_factory=dict)
    """The connector's worker counters over the run (`link_ms_in_step`, `link_ms_background`,
    passes)."""
    timeline: list[tuple[float, float]] = field(default_factory=list)
    """(token time since the arrivals, gap ms) of the decoders' tokens."""


def head_of_line(
    model: str,
    delay_s: float = 0.2,
    async_loads: bool | str = True,
    decoders: int = 2,
    new: int = 4,
    images: int = 3,
    decode_tokens: int = 96,
    warm_tokens: int = 24,
    link_share: float = 1.0,
    exact: bool = False,
) -> HeadOfLine:
    """See the module docstring; returns the decoders' ITL before and during the loads."""
    from mpic.benchmarks.delayed_s3 import delayed_s3
    from mpic.engine.vllm.requests import EngineRequest
    from mpic.storage.config import StorageConfig

    with delayed_s3(delay_s) as s3:
        storage = StorageConfig(url=s3.url, memory_bytes=0, load_workers=8)
        engine = _engine(
            model, storage, async_loads=async_loads, link_share=link_share, max_num_seqs=16
        )
        try:
            pngs = [png(100 + i) for i in range(new * images)]
            entries = [engine.cache_image(data) for data in pngs]
            media = {e.entry_id: data for e, data in zip(entries, pngs, strict=True)}
            gets0 = s3.proxy.gets

            async def run() -> tuple[list[list[float]], list[float], float, float]:
                ids = engine.processor.tokenizer("Tell a long story about ships.").input_ids
                streams: list[list[float]] = [[] for _ in range(decoders)]
                tasks = [
                    asyncio.create_task(
                        _stream(
                            engine,
                            EngineRequest(prompt_token_ids=list(ids), cache_salt=uuid.uuid4().hex),
                            decode_tokens,
                            streams[d],
                        )
                    )  # fmt: skip
                    for d in range(decoders)
                ]
                while min(len(s) for s in streams) < warm_tokens:
                    await asyncio.sleep(0.005)
                arrive = time.perf_counter()
                firsts: list[list[float]] = [[] for _ in range(new)]
                reqs = [
                    _linked(engine, entries[i * images : (i + 1) * images], f"Compare {i}",
                            media=media if exact else None)
                    for i in range(new)
                ]  # fmt: skip
                news = [asyncio.create_task(_stream(engine, r, 1, firsts[i]))
                        for i, r in enumerate(reqs)]  # fmt: skip
                await asyncio.gather(*news)
                done = max(f[0] for f in firsts)
                await asyncio.gather(*tasks)
                return streams, [f[0] - arrive for f in firsts], arrive, done

            streams, ttfts, arrive, done = asyncio.run(run())
            worker = engine.connector_stats()
            for key in ("link_spans", "read_spans"):  # seconds since the arrivals
                worker[key] = [
                    (round(a - arrive, 4), round(b - arrive, 4), *rest)
                    for a, b, *rest in worker.get(key, [])
                    if b > arrive
                ]
        finally:
            engine.close()
        gets = s3.proxy.gets - gets0
    before, during, reading, linking, timeline = [], [], [], [], []
    reads = [(a, b) for a, b, *_ in worker["read_spans"]]
    links = [(a, b) for a, b, *_ in worker["link_spans"]]
    for times in streams:
        for a, b in zip(times[1:-1], times[2:], strict=False):  # skip the first (prefill) gap
            gap = 1e3 * (b - a)
            timeline.append((b - arrive, gap))
            if b <= arrive:
                before.append(gap)
            elif a >= arrive and b <= done:
                during.append(gap)
                ra, rb = a - arrive, b - arrive  # the spans' clock
                if any(s < rb and ra < e for s, e in links):
                    linking.append(gap)
                elif any(s < rb and ra < e for s, e in reads):
                    reading.append(gap)
    unloaded = statistics.mean(before)
    loading, reads_only = _mean(during), _mean(reading)
    return HeadOfLine(
        async_loads=async_loads,
        exact=exact,
        delay_s=delay_s,
        link_share=link_share,
        itl_unloaded_ms=unloaded,
        itl_loading_ms=loading,
        itl_max_loading_ms=max(during, default=float("nan")),
        ratio=loading / unloaded,
        itl_reads_ms=reads_only,
        itl_reads_max_ms=max(reading, default=float("nan")),
        reads_gaps=len(reading),
        reads_ratio=reads_only / unloaded,
        itl_linking_ms=_mean(linking),
        new_ttft_ms=[1e3 * t for t in ttfts],
        gets=gets,
        worker=worker,
        timeline=sorted(timeline),
    )


def _mean(gaps: list[float]) -> float:
    return statistics.mean(gaps) if gaps else float("nan")


@dataclass
class Batching:
    """One batching run."""

    batch_links: bool
    requests: int
    ttft_ms: list[float]
    """Every request's time from the scheduler's resume to its first token, over the waves."""
    ttft_p50_ms: float
    stats: dict[str, int]
    policy: str = "mpic-32"


def batching(
    model: str,
    requests: int = 8,
    images: int = 3,
    batch_links: bool = True,
    waves: int = 3,
    policy: str = "mpic-32",
) -> Batching:
    """B linked requests under `policy` arriving together, their entries in the worker's
    memory tier: vLLM's scheduler is paused (`pause_generation(mode="keep")`: new requests
    queue, nothing steps) while the B are submitted, then resumed, so its next step sees all of
    them; TTFT from the resume. `waves` timed waves after a warm one."""
    import tempfile

    from mpic.storage.config import StorageConfig

    storage = StorageConfig(url=Path(tempfile.mkdtemp()).as_uri(), fsync=False)
    engine = _engine(model, storage, batch_links=batch_links, max_num_seqs=requests + 2)
    try:
        entries = [engine.cache_image(png(200 + i)) for i in range(requests * images)]

        async def wave(tag: str) -> list[float]:
            reqs = [_linked(engine, entries[i * images : (i + 1) * images], f"{tag} {i}", policy)
                    for i in range(requests)]  # fmt: skip
            await asyncio.to_thread(
                engine._call, engine.llm.pause_generation(mode="keep", clear_cache=False)
            )
            firsts: list[list[float]] = [[] for _ in reqs]
            tasks = [asyncio.create_task(_stream(engine, r, 1, firsts[i]))
                     for i, r in enumerate(reqs)]  # fmt: skip
            await asyncio.sleep(0.5)  # every request reached the (paused) scheduler
            t0 = time.perf_counter()
            await asyncio.to_thread(engine._call, engine.llm.resume_generation())
            await asyncio.gather(*tasks)
            return [1e3 * (f[0] - t0) for f in firsts]

        asyncio.run(wave("warm"))  # first-use costs (kernels, allocator) out of the way
        before = engine.connector_stats()
        ttfts = [t for w in range(waves) for t in asyncio.run(wave(f"Compare {w}"))]
        after = engine.connector_stats()
    finally:
        engine.close()
    stats = {k: after[k] - before.get(k, 0) for k in ("link_passes", "linked_requests")}
    stats["largest_pass"] = after["largest_pass"]
    return Batching(batch_links, requests, ttfts, float(np.median(ttfts)), stats, policy)


def mode_name(async_loads: bool | str, exact: bool = False) -> str:
    """A load mode in words."""
    if exact:
        return "plain vLLM prefill of the same prompts (no linking)"
    if async_loads is True:
        return "reads + linking off the step"
    if async_loads == "reads":
        return "reads off the step, linking in it"
    return "reads + linking in the step"


def write_outputs(hol: list[HeadOfLine], bat: list[Batching], out: Path) -> None:
    """JSON and two PNGs (`linking_hol.png`, `linking_batch.png`) into `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "linking.json").write_text(
        json.dumps(
            {"head_of_line": [asdict(h) for h in hol], "batching": [asdict(b) for b in bat]},
            indent=1,
        )  # fmt: skip
    )
    if hol:
        fig, ax = plt.subplots(figsize=(8, 4))
        for h in hol:
            xs, ys = zip(*h.timeline, strict=False) if h.timeline else ([], [])
            label = f"{mode_name(h.async_loads, h.exact)}: ITL x{h.ratio:.2f}"
            ax.plot(xs, ys, ".-", ms=3, lw=0.8, label=label)
        ax.axvline(0, color="gray", ls="--", lw=0.8)
        for h in hol[:1]:  # the first run's reads and link passes
            for a, b, *_ in h.worker.get("read_spans", []):
                ax.axvspan(a, b, color="tab:green", alpha=0.08, lw=0)
            for a, b, *_ in h.worker.get("link_spans", []):
                ax.axvspan(a, b, color="tab:red", alpha=0.15, lw=0)
        ax.set_xlabel(
            "token time (s) since the new requests arrived (first run: reads green, links red)"
        )
        ax.set_ylabel("decoders' inter-token gap (ms)")
        ax.set_yscale("log")
        delay = hol[0].delay_s * 1e3
        ax.set_title(f"Decoding while new requests' entries load (S3 GET +{delay:.0f} ms)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "linking_hol.png", dpi=120)
        plt.close(fig)
    if bat:
        fig, ax = plt.subplots(figsize=(6, 4))
        for b in bat:
            xs = np.sort(b.ttft_ms)
            label = (
                f"{b.policy}, {'one pass' if b.batch_links else 'one pass per request'} "
                f"(p50 {b.ttft_p50_ms:.0f} ms, largest pass {b.stats['largest_pass']})"
            )
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), "o-", label=label)
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{bat[0].requests} linked requests arriving together")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "linking_batch.png", dpi=120)
        plt.close(fig)


def command(
    model: str = typer.Option(None, "--model", help="Model folder (default: the demo's LLaVA)."),
    delay_ms: float = typer.Option(200.0, "--delay-ms", min=0, help="S3 GET delay."),
    requests: int = typer.Option(8, "--requests", min=1, max=64, help="Batching: requests."),
    link_share: float = typer.Option(
        1.0, "--link-share", min=0.01, max=1.0, help="Linking thread's share while decoding."
    ),
    modes: str = typer.Option(
        "reads,background,step,exact",
        "--modes",
        help="Head-of-line load modes to run (exact: the same prompts as plain vLLM requests).",
    ),
    out: str = typer.Option("out/linking", "--out", help="Folder for JSON and PNGs."),
) -> None:
    """Head-of-line (async vs sync entry reads) and batched linking on the vLLM worker."""
    from rich.console import Console
    from rich.table import Table

    from mpic.deployments.local import prepare_local

    if model is None:
        from mpic.deployments.config import ServeAppConfig

        model = prepare_local(ServeAppConfig()).engine.model
    names = {"background": True, "reads": "reads", "step": False, "exact": "reads"}
    chosen = [m.strip() for m in modes.split(",") if m.strip()]
    if unknown := set(chosen) - set(names):
        raise typer.BadParameter(f"unknown mode(s) {sorted(unknown)}; choose from {list(names)}")
    hol = [
        head_of_line(
            model, delay_ms / 1e3, names[m], link_share=link_share, exact=m == "exact"
        )  # fmt: skip
        for m in chosen
    ]
    bat = [
        batching(model, requests, batch_links=b, policy=p)
        for p in ("mpic-32", "auto")  # the default joins the batched pass too
        for b in (True, False)
    ]
    table = Table(title="Linking on the vLLM worker")
    for col in ["run", "figure"]:
        table.add_column(col)
    for h in hol:
        table.add_row(
            f"{mode_name(h.async_loads, h.exact)}, GET +{h.delay_s * 1e3:.0f} ms",
            f"ITL {h.itl_unloaded_ms:.1f} -> {h.itl_loading_ms:.1f} ms (x{h.ratio:.2f}, max "
            f"{h.itl_max_loading_ms:.0f}); while only reads run {h.itl_reads_ms:.1f} ms "
            f"(x{h.reads_ratio:.2f}, max {h.itl_reads_max_ms:.0f}, {h.reads_gaps} gaps); "
            f"over link passes {h.itl_linking_ms:.1f} ms; "
            f"new TTFT p50 {np.median(h.new_ttft_ms):.0f} ms",
        )
    for b in bat:
        table.add_row(
            f"{b.policy}: {'one pass' if b.batch_links else 'one pass per request'}",
            f"TTFT p50 {b.ttft_p50_ms:.0f} ms; {b.stats}",
        )
    Console().print(table)
    write_outputs(hol, bat, Path(out))
