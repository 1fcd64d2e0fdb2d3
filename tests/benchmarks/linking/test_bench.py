"""Linking under load on the vLLM worker (issue 22 items 2 and 3; `mpic.benchmarks.linking.bench`)
with the tiny LLaVA:

- head-of-line: with the object store answering every GET 200 ms late and a 0-byte memory tier
  (every entry read is a delayed GET), requests already decoding keep their inter-token latency
  while 4 new requests' 12 entries load in the background (the default load mode, "reads");
  with reads and linking in the step (`async_loads=False`) the same run stalls
  decoding. The bounds are sanity bounds far from the stall they guard (a step waiting on S3
  shows gaps of seconds): the async run's largest gap is a quarter of the sync run's at most,
  its mean ITL at most 8x the unloaded one, over the whole window and over the gaps while only
  reads ran (the worker's spans), and a tenth of the sync run's mean. Measured: 0.8-0.85x alone,
  2.28x in one CI run (a busy 2-core host; tiny-model ITL is ~5 ms, so a few ms of noise moves
  the ratio a lot) against 115x for the sync run; the 1.2x figures are the benchmark's,
  docs/vllm.md "Under load";
- batching: 8 linked requests arriving together are linked in one link pass (the connector's
  counter), under mpic-32, the default, full reuse and CacheBlend; their TTFT p50 is a sanity
  bound (at most 1.5x one pass per request's): on the tiny model the two differ by a few ms
  (41.2 vs 40.2 ms in one full-suite run, the other way round in the next), so which is lower
  is the benchmark's figure (`mpic bench linking`), not this test's.
Exactness of batched passes: `test_vllm_linking.py` (8 requests in flight equal one at a time)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mpic.benchmarks.linking.batching import batching
from mpic.benchmarks.linking.head_of_line import head_of_line

pytestmark = pytest.mark.slow


def test_entry_reads_do_not_stall_decoding(tiny_llava_dir: Path) -> None:
    run = head_of_line(str(tiny_llava_dir), delay_s=0.2, async_loads="reads")  # the default
    print(run.itl_unloaded_ms, run.itl_loading_ms, run.itl_max_loading_ms, run.new_ttft_ms)
    assert run.gets >= 12  # every entry came from the delayed store
    assert min(run.new_ttft_ms) > 200  # the new requests did wait for their GETs
    assert run.ratio <= 8.0
    # the gaps while only reads ran (no link pass): the step never waited on a 200 ms GET
    assert run.reads_gaps >= 5 and run.reads_ratio <= 8.0
    sync = head_of_line(str(tiny_llava_dir), delay_s=0.2, async_loads=False)
    print(sync.itl_unloaded_ms, sync.itl_loading_ms, sync.itl_max_loading_ms)
    assert sync.itl_max_loading_ms > 200  # reads inside the step: decoding waits on S3
    assert run.itl_max_loading_ms * 4 < sync.itl_max_loading_ms
    assert run.itl_loading_ms * 10 < sync.itl_loading_ms


@pytest.mark.parametrize("policy", ["mpic-32", "auto", "full-reuse", "cacheblend-15"])
def test_eight_arriving_together_are_linked_in_one_pass(tiny_llava_dir: Path, policy: str) -> None:
    # the default `auto` (scout + correction) joins the batched pass too (issue 33 item 1), and
    # so do two-step policies (full reuse: their text-first passes are one pass too) and
    # CacheBlend (its in-pass check over its own rows)
    together = batching(str(tiny_llava_dir), requests=8, batch_links=True, policy=policy)
    apart = batching(str(tiny_llava_dir), requests=8, batch_links=False, policy=policy)
    print(together.ttft_ms, together.stats, apart.ttft_ms, apart.stats)
    waves = len(together.ttft_ms) // 8
    assert together.stats["largest_pass"] == 8 and together.stats["link_passes"] == waves
    assert apart.stats["largest_pass"] == 1 and apart.stats["link_passes"] == 8 * waves
    if policy == "mpic-32":  # the shared layer compute is most of a plain pass
        assert together.ttft_p50_ms < 1.5 * apart.ttft_p50_ms
    # the default's scouts and corrected attention run per request inside the shared pass, so on
    # the tiny model its p50 is not bounded by one pass per request's (170 vs 64 ms in one full
    # run): the benchmark's figure, docs/vllm.md
