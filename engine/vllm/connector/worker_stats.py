"""The counters of the MPIC connector's worker half (`MPICWorker.stats`, vLLM worker process),
read by the engine's owner with `collective_rpc("mpic_connector_stats")`
(`mpic.engine.vllm.plugin`).

They count link passes and requests (`link_passes`, `linked_requests`, `largest_pass`, `failed`,
`read_ahead`), scouting passes (`scout_passes`, `scouted_requests`, `largest_scout_pass`),
prefixes (`prefix_linked` requests, `prefix_tokens`, `prefix_contexts` prefilled: counted by
`mpic.engine.vllm.connector.linking.RequestLinker`) and link time (`link_ms_in_step`,
`link_ms_background`) with recent spans (`link_spans`, `read_spans`). The worker's lock guards
them: call these with it held.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mpic.linker.pipeline import LinkedPrefill

SPANS_KEPT = 64
"""How many recent spans `stats["link_spans"]` and `stats["read_spans"]` keep."""


def new_stats() -> dict[str, Any]:
    """Every counter at zero.

    `scout_passes`: one per link pass with scouting requests (`scouted_requests`); `link_ms_*`:
    wall time of link passes inside steps / on the linking thread; `link_spans` (set when first
    kept): the last 64 link batches (start, end, requests, "step" or "thread"); `read_spans`: the
    last 64 async jobs' reads (start, all entries in memory, entries), both in
    `time.perf_counter` (CLOCK_MONOTONIC: comparable across this host's processes; `mpic bench
    linking` lays them beside the decoders' tokens)."""
    return {
        "link_passes": 0,
        "linked_requests": 0,
        "largest_pass": 0,
        "scout_passes": 0,
        "scouted_requests": 0,
        "largest_scout_pass": 0,
        "failed": 0,
        "link_ms_in_step": 0.0,
        "link_ms_background": 0.0,
        "read_ahead": 0,
        "prefix_linked": 0,
        "prefix_tokens": 0,
        "prefix_contexts": 0,
    }


def keep_span(stats: dict[str, Any], key: str, span: tuple) -> None:
    """Keep `span` among the last `SPANS_KEPT` of `stats[key]` (`link_spans`, `read_spans`); a
    new list: a copy of `stats` being sent never sees it change."""
    stats[key] = [*stats.get(key, [])[-(SPANS_KEPT - 1) :], span]


def count_pass(stats: dict[str, Any], requests: int, outs: Sequence[LinkedPrefill] = ()) -> None:
    """One link pass of `requests` requests done (`outs`: their outcomes, for the scouting
    counters: the pass's one scouting pass, over all its scouting requests)."""
    scouted = sum(1 for out in outs if out.scout is not None and out.scout.layers_run)
    stats["link_passes"] += 1
    stats["linked_requests"] += requests
    stats["largest_pass"] = max(stats["largest_pass"], requests)
    if scouted:
        stats["scout_passes"] += 1
        stats["scouted_requests"] += scouted
        stats["largest_scout_pass"] = max(stats["largest_scout_pass"], scouted)
