"""The worker half of the MPIC KV connector (vLLM worker process).

Each step it receives the scheduler half's `MPICConnectorMetadata` (`mpic.engine.vllm.link_job`):

- async jobs (`LinkJob.load_async`): their entries are read from the tiered entry store
  (memory -> disk -> object store, `mpic.storage.entry_store.EntryStore`) on a thread pool, one
  read per entry, all entries of all jobs in parallel, while vLLM keeps stepping the running
  requests. In every later step, the jobs whose entries are all in memory are linked (below)
  before the step ends and reported finished receiving (`transfer_results`); a job whose read
  failed is reported failed receiving (its blocks untouched), vLLM fails the request and the
  engine wrapper answers it by exact recomputation. So no step waits on disk or S3: a step
  waits only on the linking compute of requests whose entries are already in memory.
- sync jobs (compression requests, and the rare request whose last token has no block yet under a
  policy that reads it): entries read and request linked in `start_load_kv`, before the forward.

Linking: the jobs ready in one step whose policy is plain (`link_job.batchable`) go through ONE
selective pass together (`mpic.engine.vllm.batched_link`); the others, one at a time, through the
linker's `link_and_prefill` (text-first pass, in-pass hooks, scouting, corrections) with vLLM's
modules (`VllmLayerAdapter`) into their paged blocks (`PagedLinkedKV`). A request whose params
carry `mpic_press` is an item's canonical prompt: its prefill is observed and the item's
compressed entry written to the store (`mpic.engine.vllm.presses`). `stats` counts passes and
requests (`link_passes`, `linked_requests`, `largest_pass`, `failed`), read by the engine's owner
with `collective_rpc("mpic_connector_stats")`.

The model: the `mpic` vLLM plugin hands this process's model runner to `attach_runner` right
after vLLM built the connector (through vLLM's own `get_kv_transfer_group()`; see
`mpic.engine.vllm.plugin` for why vLLM allows no other way without insecure serialization).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from mpic.engine.hf.compress import press_item_entry
from mpic.engine.vllm import upload as vllm_upload
from mpic.engine.vllm.adapter import VllmLayerAdapter
from mpic.engine.vllm.batched_link import BatchItem, link_batch
from mpic.engine.vllm.link_job import LinkJob, MPICConnectorMetadata, batchable
from mpic.engine.vllm.paged_kv import PagedLinkedKV
from mpic.errors import MPICError
from mpic.linker.pipeline import link_and_prefill
from mpic.linker.policies import get_policy
from mpic.linker.recipe import PlannedPrompt
from mpic.storage.config import StorageConfig
from mpic.storage.entry_store import EntryStore
from mpic.storage.object_store import ObjectNotFoundError
from mpic.types import CacheEntry, LinkPlan

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

logger = logging.getLogger(__name__)

LOAD_ERRORS = (ObjectNotFoundError, MPICError, OSError, ValueError, KeyError, RuntimeError)
"""What a failed entry read or link raises (the request then falls back to recomputation)."""


@dataclasses.dataclass
class _Loading:
    """An async job whose entries are being read."""

    job: LinkJob
    reads: dict[str, Future]
    began: float


class MPICWorker:
    """Entry reads in the background and linking into vLLM's paged KV (module docstring).

    block_size: vLLM's KV block size; storage: the entry store's config; fetch_threads: entry
    reads in flight at once (all jobs together); batch_links: False links every request in a
    pass of its own (the one-after-the-other baseline)."""

    def __init__(
        self,
        block_size: int,
        storage: StorageConfig,
        fetch_threads: int = 8,
        batch_links: bool = True,
    ) -> None:
        self.block_size = block_size
        self.batch_links = batch_links
        self._storage = storage
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._runner: Any = None
        self._adapter: VllmLayerAdapter | None = None
        self._store: EntryStore | None = None
        self._capture: vllm_upload.KVCapture | None = None
        self._pool = ThreadPoolExecutor(fetch_threads, thread_name_prefix="mpic-entry-read")
        self._loading: dict[str, _Loading] = {}
        self._recved: set[str] = set()
        self._failed: set[str] = set()
        self._dropped: set[str] = set()
        self._failed_blocks: set[int] = set()
        self.stats = {"link_passes": 0, "linked_requests": 0, "largest_pass": 0, "failed": 0}
        self._shifted: list[PagedLinkedKV] = []
        """Linked KV whose keys are shifted for this step's forward (restored after it)."""

    # ---------------------------------------------------------------- set-up
    def attach_runner(self, runner: Any) -> None:
        """The model runner of this worker (handed over by the `mpic` vLLM plugin)."""
        self._runner = runner

    def runner(self) -> Any:
        if self._runner is None:
            raise RuntimeError(
                "MPIC connector: no model runner was handed over; is the `mpic` vLLM plugin "
                "installed (entry point vllm.general_plugins)?"
            )
        return self._runner

    def adapter(self) -> VllmLayerAdapter:
        if self._adapter is None:
            self._adapter = VllmLayerAdapter(self.runner().get_model())
        return self._adapter

    def store(self) -> EntryStore:
        if self._store is None:
            self._store = EntryStore.from_config(self._storage)
        return self._store

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the per-layer paged KV tensors ([num_blocks, H_kv, block_size, 2*D])."""
        self._kv_caches = dict(kv_caches)

    # ---------------------------------------------------------------- per step
    def bind(self, meta: MPICConnectorMetadata, attn_metadata: Any) -> None:
        """Before the forward: arm upload capture (vLLM calls `start_load_kv` after the forward
        when the step has no synchronous load)."""
        if meta.uploads or self._capture is not None:
            if self._capture is None:
                self._capture = vllm_upload.KVCapture(self.runner().get_model(), self.adapter())
            self._capture.begin_step(meta.uploads, self.runner(), attn_metadata)

    def start_load_kv(self, meta: MPICConnectorMetadata) -> None:
        """Drop jobs of ended requests, start the reads of new async jobs, link the sync jobs
        and every async job whose entries are in memory (one batched pass where possible)."""
        for rid in meta.finished:  # ended while loading: drop it, vLLM frees its blocks
            loading = self._loading.pop(rid, None)
            if loading is None:  # already reported finished receiving: vLLM freed them then
                continue
            for read in loading.reads.values():
                read.cancel()
            self._dropped.add(rid)
        ready: list[tuple[LinkJob, list[CacheEntry]]] = []
        for job in meta.jobs:
            if job.load_async:
                store = self.store()
                reads = {}
                for e in dict.fromkeys(job.entry_ids):
                    if e in store.memory:  # a memory hit waits on nothing: read it now
                        reads[e] = Future()
                        try:
                            reads[e].set_result(store.get(e))
                        except LOAD_ERRORS as exc:
                            reads[e].set_exception(exc)
                    else:  # disk or the object store: in the background
                        reads[e] = self._pool.submit(store.get, e)
                self._loading[job.req_id] = _Loading(job, reads, time.perf_counter())
                continue
            try:  # synchronous: read now (in this step)
                ready.append((job, [self.store().get(e) for e in job.entry_ids]))
            except LOAD_ERRORS as exc:
                self._fail(job, exc)
        for rid, loading in list(self._loading.items()):
            if not all(r.done() for r in loading.reads.values()):
                continue
            del self._loading[rid]
            try:
                got = {e: r.result() for e, r in loading.reads.items()}
            except LOAD_ERRORS as exc:
                self._fail(loading.job, exc)
                continue
            logger.debug(
                "MPIC: %s entries in memory after %.1f ms",
                rid,
                1e3 * (time.perf_counter() - loading.began),
            )
            ready.append((loading.job, [got[e] for e in loading.job.entry_ids]))
        if ready:
            self._link_all(ready)

    def _fail(self, job: LinkJob, exc: BaseException) -> None:
        # The request fails (kv_load_failure_policy="fail"); the engine wrapper then answers it
        # exactly by plain recomputation (VllmEngine.generate, AsyncVllmEngine.stream).
        logger.warning("MPIC: cannot link %s, failing it: %s", job.req_id, exc)
        self.stats["failed"] += 1
        if job.load_async:
            self._failed.add(job.req_id)
            self._recved.add(job.req_id)
        else:
            self._failed_blocks.update(job.block_ids)

    def _link_all(self, ready: list[tuple[LinkJob, list[CacheEntry]]]) -> None:
        adapter = self.adapter()
        layers = [adapter.attention_layer(i) for i in range(adapter.num_layers)]
        caches = [self._kv_caches[layer.layer_name] for layer in layers]
        batch: list[tuple[LinkJob, BatchItem]] = []
        for job, entries in ready:
            began = time.perf_counter()
            try:
                plan = job.plan()
                policy = get_policy(job.policy)
                if job.press is None and batchable(policy):
                    plan = self._fit(job, plan)
                    kv = PagedLinkedKV(layers, caches, job.block_ids, self.block_size)
                    batch.append((job, BatchItem(plan, entries, kv, job.block_ids)))
                    continue
                self._link_one(job, plan, entries, layers, caches)
            except LOAD_ERRORS as exc:
                self._fail(job, exc)
                continue
            self._linked([job], began)
        groups = [batch] if self.batch_links else [[one] for one in batch]
        for group in groups if batch else []:
            began = time.perf_counter()
            try:
                link_batch(adapter, [item for _, item in group], layers, caches, self.block_size)
            except LOAD_ERRORS as exc:
                for job, _ in group:
                    self._fail(job, exc)
                continue
            self._linked([job for job, _ in group], began)

    def _fit(self, job: LinkJob, plan: LinkPlan) -> LinkPlan:
        """The plan cut before the last token when that token has no block yet (an async claim
        of N-1 tokens allocates blocks for N-1 only): vLLM's forward computes it."""
        if job.num_tokens <= len(job.block_ids) * self.block_size:
            return plan
        n = job.num_tokens - 1
        return dataclasses.replace(
            plan,
            token_ids=plan.token_ids[:n],
            positions=plan.positions[..., :n],
            source_entry=plan.source_entry[:n],
            source_offset=plan.source_offset[:n],
            recompute_depth=plan.recompute_depth[:n],
        )

    def _link_one(
        self,
        job: LinkJob,
        plan: LinkPlan,
        entries: list[CacheEntry],
        layers: list,
        caches: list[torch.Tensor],
    ) -> None:
        """The linker's `link_and_prefill` over the whole prompt, into the request's blocks.

        Token N-1 runs too (its block exists), so in-pass selections see the same tokens as in
        the reference runner; vLLM's forward then recomputes it identically. The plan's depths
        are the front end's (`mpic.linker.recipe` applied the policy once); the policy object
        only drives two-step passes and in-pass hooks here."""
        adapter = self.adapter()
        policy = get_policy(job.policy)
        planned = PlannedPrompt(plan, entries, policy, refs=[])
        mirror = values = None
        shape = (adapter.num_layers, plan.num_tokens, adapter.num_kv_heads, adapter.head_dim)
        if policy.layer_hook(plan, adapter.num_layers) is not None or job.press is not None:
            # CacheBlend and the presses read linked keys
            mirror = torch.zeros(shape, dtype=adapter.dtype)
        if policy.corrects:  # the linked-key correction attends over K/V mirrors (CPU cache)
            mirror = torch.zeros(shape, dtype=adapter.dtype)
            values = torch.zeros(shape, dtype=adapter.dtype)
        kv = PagedLinkedKV(
            layers, caches, job.block_ids, self.block_size, keys=mirror, values=values
        )
        kv.clear()  # the "dummy cache" of zeros, as in the reference runner's dense KV
        if job.press is None:
            link_and_prefill(adapter, planned, kv)
            if kv.shift_for_last_query(plan.num_tokens - 1):  # vLLM's forward of token N-1
                self._shifted.append(kv)
        else:  # the item's canonical prefill, observed; its compressed entry -> the store
            entry = press_item_entry(adapter, planned, kv, job.press.press, job.press.budget)
            self.store().put(entry)

    def _linked(self, jobs: list[LinkJob], began: float) -> None:
        self.stats["link_passes"] += 1
        self.stats["linked_requests"] += len(jobs)
        self.stats["largest_pass"] = max(self.stats["largest_pass"], len(jobs))
        for job in jobs:
            if job.load_async:
                self._recved.add(job.req_id)
        logger.debug(
            "MPIC: linked %d request(s) in one pass in %.1f ms",
            len(jobs),
            1e3 * (time.perf_counter() - began),
        )

    def wait_for_save(self) -> None:
        """After the forward: put back the linked keys shifted for it, and finish uploads whose
        prompt has fully run (entry -> store)."""
        shifted, self._shifted = self._shifted, []
        for kv in shifted:
            kv.restore()
        if self._capture is not None:
            self._capture.end_step(self.store().put)

    def transfer_results(self) -> KVConnectorTransferResults:
        """Async jobs linked (finished receiving) or failed (also failed receiving) since the
        last call, and dropped jobs of ended requests (finished sending: blocks freed)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorTransferResults,
        )

        out = KVConnectorTransferResults(
            finished_sending=self._dropped,
            finished_recving=self._recved,
            failed_recving=self._failed,
        )
        self._dropped, self._recved, self._failed = set(), set(), set()
        return out

    def block_ids_with_load_errors(self) -> set[int]:
        """Blocks of sync jobs whose entries could not be loaded this step (then cleared)."""
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
