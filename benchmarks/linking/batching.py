"""Batched linking of `mpic bench linking` (CLI process; vLLM's engine core and worker in child
processes): B linked requests whose entries sit in the worker's memory tier arrive together; their
TTFT with the step's requests linked in one selective pass (`batch_links`) or one pass per
request, and the connector's pass counters (see `mpic.benchmarks.linking.bench`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpic.benchmarks.linking.requests import linked_request, png, stream_tokens, vllm_engine


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
    engine = vllm_engine(model, storage, batch_links=batch_links, max_num_seqs=requests + 2)
    try:
        entries = [engine.cache_image(png(200 + i)) for i in range(requests * images)]

        async def wave(tag: str) -> list[float]:
            reqs = [
                linked_request(engine, entries[i * images : (i + 1) * images], f"{tag} {i}", policy)
                for i in range(requests)
            ]
            await asyncio.to_thread(
                engine._call, engine.llm.pause_generation(mode="keep", clear_cache=False)
            )
            firsts: list[list[float]] = [[] for _ in reqs]
            tasks = [asyncio.create_task(stream_tokens(engine, r, 1, firsts[i]))
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
