"""Head-of-line of `mpic bench linking` (CLI process; vLLM's engine core and worker in child
processes): D requests decode while M new linked requests arrive whose entries live only in an
object store that answers every GET late (`mpic.benchmarks.delayed_s3`); the decoders'
inter-token latency while the new requests load and link against their ITL before the arrivals,
split by the worker's read and link spans (see `mpic.benchmarks.linking.bench`).
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from mpic.benchmarks.linking.requests import linked_request, png, stream_tokens, vllm_engine


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
        engine = vllm_engine(
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
                        stream_tokens(
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
                    linked_request(engine, entries[i * images : (i + 1) * images], f"Compare {i}",
                            media=media if exact else None)
                    for i in range(new)
                ]  # fmt: skip
                news = [asyncio.create_task(stream_tokens(engine, r, 1, firsts[i]))
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
