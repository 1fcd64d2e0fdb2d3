"""The worker half of the MPIC KV connector (vLLM worker process): the connector API's glue.

Each step it receives the scheduler half's `MPICConnectorMetadata`
(`mpic.engine.vllm.connector.link_job`):

- async jobs (`LinkJob.load_async`): their entries are read from the tiered entry store on a
  thread pool (`mpic.engine.vllm.connector.entry_reads`) while vLLM keeps stepping the running
  requests. The jobs whose entries are all in memory are linked in that step, before its forward
  (load mode `reads`, the default), or go to the linking thread, which links them while vLLM's
  forwards go on (`background`); they are then reported finished receiving
  (`transfer_results`). A job whose read failed is reported failed receiving (its blocks
  untouched), vLLM fails the request and the engine wrapper answers it by exact recomputation.
  So no step waits on disk or S3 (under `background`, nor on a selective pass). The read and
  linking threads leave the cores vLLM bound its forward to.
  Second phases (`LinkJob.phase2`): "link" jobs are read ahead and reported received unlinked,
  then come back synchronous; "shift" jobs (corrected policies) are linked here and their keys
  shifted in `bind` when vLLM schedules their last token (`MPICConnectorMetadata.shift`).
- sync jobs (compression requests, second phases, load mode `step`): entries read (or taken
  from those read ahead) and the request linked in `start_load_kv`, before the forward.

Linking (`mpic.engine.vllm.connector.linking.RequestLinker`): the jobs ready together whose
policy joins a batch go through ONE link pass together (one scouting pass for the scouting
requests, one selective pass for all); the others one at a time; the template/system prefix
linked exactly (`link_prefix`, on by default). `stats` counts passes, requests, scouting passes,
prefixes and link time with recent spans (`mpic.engine.vllm.connector.worker_stats`), read by the
engine's owner with `collective_rpc("mpic_connector_stats")`.

The model: the `mpic` vLLM plugin hands this process's model runner to `attach_runner` right
after vLLM built the connector (through vLLM's own `get_kv_transfer_group()`; see
`mpic.engine.vllm.plugin` for why vLLM allows no other way without insecure serialization).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from mpic.engine.vllm import upload as vllm_upload
from mpic.engine.vllm.connector.adapter import VllmLayerAdapter
from mpic.engine.vllm.connector.entry_reads import LOAD_ERRORS, EntryReads, off_forward
from mpic.engine.vllm.connector.link_job import LinkJob, MPICConnectorMetadata, load_mode
from mpic.engine.vllm.connector.linking import RequestLinker
from mpic.engine.vllm.connector.model_lock import (
    LinkPacer,
    ModelLock,
    YieldingAdapter,
    guard_runner,
)
from mpic.engine.vllm.connector.paged_kv import PagedLinkedKV
from mpic.engine.vllm.connector.worker_stats import count_pass, keep_span, new_stats
from mpic.linker.pipeline import LinkedPrefill
from mpic.storage.config import StorageConfig
from mpic.storage.entry_store import EntryStore
from mpic.types import CacheEntry, LinkPlan

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

logger = logging.getLogger(__name__)


class MPICWorker:
    """Entry reads and linking in the background, into vLLM's paged KV (module docstring).

    block_size: vLLM's KV block size; storage: the entry store's config; fetch_threads: entry
    reads in flight at once (all jobs together); batch_links: False links every request in a
    pass of its own (the one-after-the-other baseline); async_loads: the load mode
    (`link_job.load_mode`: "background" links async jobs on the linking thread, "reads" in the
    step after their reads); link_share: the linking thread's share of the wall time while
    vLLM's forwards run (`mpic.engine.vllm.connector.model_lock`, "Pacing"; 1.0: full speed);
    link_prefix: link the template/system prefix exactly (module docstring; False: recompute it)."""

    def __init__(
        self,
        block_size: int,
        storage: StorageConfig,
        fetch_threads: int = 8,
        batch_links: bool = True,
        async_loads: bool | str = True,
        link_share: float = 1.0,
        link_prefix: bool = True,
    ) -> None:
        self.block_size = block_size
        self.mode = load_mode(async_loads)
        self._last_forward = 0.0
        self._pacer = LinkPacer(link_share, self._decoding)
        self._model_lock = ModelLock()
        """vLLM's step and the linking thread take turns on the model (`model_lock`)."""
        self._storage = storage
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._runner: Any = None
        self._adapter: VllmLayerAdapter | None = None
        self._store: EntryStore | None = None
        self._capture: vllm_upload.KVCapture | None = None
        self._main_cpus: set[int] = set()
        self._reads = EntryReads(self.store, fetch_threads, lambda: self._main_cpus)
        self._link_thread = ThreadPoolExecutor(
            1, thread_name_prefix="mpic-link", initializer=self._on_linking_thread
        )
        self._lock = threading.Lock()
        """Guards what the linking thread reports (`_recved`, `_failed`, `_dropped`, stats)."""
        self._ready: list[tuple[LinkJob, list[CacheEntry]]] = []
        """Async jobs whose entries are in memory, waiting for the linking thread."""
        self._linking: set[str] = set()
        """Async jobs on the linking thread now."""
        self._linking_future: Future | None = None
        self._drop_when_linked: set[str] = set()
        self._held: dict[str, list[CacheEntry]] = {}
        """Entries read ahead for a second-phase link (`LinkJob.phase2 == "link"`)."""
        self._to_shift: dict[str, tuple[PagedLinkedKV, int]] = {}
        """Corrected requests linked in the background, keys to shift in their last token's
        step (`LinkJob.phase2 == "shift"`): their linked KV and last prompt index."""
        self._recved: set[str] = set()
        self._failed: set[str] = set()
        self._dropped: set[str] = set()
        self._failed_blocks: set[int] = set()
        self.stats: dict[str, Any] = new_stats()
        """Counters (`mpic.engine.vllm.connector.worker_stats.new_stats`), under `_lock`."""
        self._linker = RequestLinker(
            block_size,
            link_prefix,
            batch_links,
            self.adapter,
            self.store,
            lambda: self._kv_caches,  # registered after this
            self.stats,
            self._lock,
        )
        self._shifted: list[PagedLinkedKV] = []
        """Linked KV whose keys are shifted for this step's forward (restored after it)."""

    # ---------------------------------------------------------------- set-up
    def attach_runner(self, runner: Any) -> None:
        """The model runner of this worker (handed over by the `mpic` vLLM plugin)."""
        self._runner = runner
        self._main_cpus = os.sched_getaffinity(0)  # vLLM bound this (its forward's) thread
        if self.mode == "background":  # vLLM's CPU kernels are not thread-safe (model_lock)
            guard_runner(runner, self._model_lock)

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
        """Before the forward: shift the keys of corrected requests whose last prompt token
        this forward runs, and arm upload capture (vLLM calls `start_load_kv` after the
        forward when the step has no synchronous load)."""
        if attn_metadata is not None:  # a forward runs in this step (else none is scheduled)
            self._last_forward = time.perf_counter()
        for rid in meta.shift:
            linked = self._to_shift.pop(rid, None)
            if linked is not None and linked[0].shift_for_last_query(linked[1]):
                self._shifted.append(linked[0])
        if meta.uploads or self._capture is not None:
            if self._capture is None:
                self._capture = vllm_upload.KVCapture(self.runner().get_model(), self.adapter())
            self._capture.begin_step(meta.uploads, self.runner(), attn_metadata)

    def start_load_kv(self, meta: MPICConnectorMetadata) -> None:
        """Drop jobs of ended requests, start the reads of new async jobs, link the sync jobs
        (in this step), and hand every async job whose entries are in memory to the linking
        thread (load mode `background`; `reads`: link it in this step)."""
        for rid in meta.forget:
            self._held.pop(rid, None)
            self._to_shift.pop(rid, None)
        for rid in meta.finished:  # ended while loading: drop it, vLLM frees its blocks
            self._drop(rid)
        in_step: list[tuple[LinkJob, list[CacheEntry]]] = []
        for job in meta.jobs:
            if job.load_async:
                self._reads.start(job)
                continue
            try:  # synchronous (or a second phase): read now unless read ahead
                held = self._held.pop(job.req_id, None)
                in_step.append((job, held or [self.store().get(e) for e in job.entry_ids]))
            except LOAD_ERRORS as exc:
                self._fail(job, exc)
        for loaded in self._reads.finished():
            rid = loaded.job.req_id
            if loaded.error is not None:
                self._fail(loaded.job, loaded.error)
                continue
            now = time.perf_counter()
            logger.debug("MPIC: %s entries in memory in %.1f ms", rid, 1e3 * (now - loaded.began))
            self._span("read_spans", (loaded.began, now, loaded.reads))
            entries = loaded.entries
            if loaded.job.phase2 == "link":  # linked in its last token's step
                self._held[rid] = entries
                with self._lock:
                    self._recved.add(rid)
                    self.stats["read_ahead"] += 1
            elif self.mode == "background":
                self._ready.append((loaded.job, entries))
            else:
                in_step.append((loaded.job, entries))
        if in_step:
            began = time.perf_counter()
            self._link_all(in_step)
            end = time.perf_counter()
            self.stats["link_ms_in_step"] += 1e3 * (end - began)
            self._span("link_spans", (began, end, len(in_step), "step"))
        self._start_linking()

    def _span(self, key: str, span: tuple) -> None:
        """Keep `span` among the recent ones of `stats[key]` (`worker_stats.keep_span`)."""
        with self._lock:
            keep_span(self.stats, key, span)

    def _drop(self, rid: str) -> None:
        """A request ended while its async job was with this worker."""
        if not self._reads.cancel(rid):
            with self._lock:
                if rid in self._linking:  # on the linking thread: reported when linked
                    self._drop_when_linked.add(rid)
                    return
            if not any(job.req_id == rid for job, _ in self._ready):
                return  # already reported finished receiving: vLLM freed the blocks then
            self._ready = [r for r in self._ready if r[0].req_id != rid]
        with self._lock:
            self._dropped.add(rid)

    def _start_linking(self) -> None:
        """Hand the ready jobs to the linking thread unless it is busy (what becomes ready
        meanwhile goes in its next batch)."""
        if not self._ready or (self._linking_future and not self._linking_future.done()):
            return
        ready, self._ready = self._ready, []
        with self._lock:
            self._linking = {job.req_id for job, _ in ready}
        self._linking_future = self._link_thread.submit(self._link_in_background, ready)

    def _on_linking_thread(self) -> None:
        """The linking thread off the forward's cores. Its OpenMP thread count stays as it is:
        that count is process-wide here, and changing it changed the forward's numerics (a
        greedy answer diverged after a preemption in `test_vllm_linking.py`)."""
        off_forward(self._main_cpus)
        self.stats["linking_thread_cores"] = len(os.sched_getaffinity(0))

    def _link_in_background(self, ready: list[tuple[LinkJob, list[CacheEntry]]]) -> None:
        """The linking thread: link `ready` (vLLM's forwards go on in the main thread; these
        requests' blocks are theirs alone until reported)."""
        began = time.perf_counter()
        self._pacer.start()
        try:
            with torch.inference_mode(), self._model_lock.linking():
                self._link_all(ready, paced=True)
        except Exception as exc:  # noqa: BLE001 - never lose a job: fail the unreported
            logger.exception("MPIC: the linking thread failed")
            with self._lock:
                left = set(self._linking)
            for job, _ in ready:
                if job.req_id in left:
                    self._fail(job, exc)
        finally:
            end = time.perf_counter()
            with self._lock:
                self.stats["link_ms_background"] += 1e3 * (end - began)
                self.stats["link_ms_paused"] = 1e3 * self._pacer.slept_s
            self._span("link_spans", (began, end, len(ready), "thread"))

    def _report(self, job: LinkJob, failed: bool) -> None:
        """An async job is done (call with the lock held): finished receiving (and failed
        receiving when `failed`), or finished sending when its request ended meanwhile."""
        rid = job.req_id
        self._linking.discard(rid)
        if rid in self._drop_when_linked:
            self._drop_when_linked.discard(rid)
            self._to_shift.pop(rid, None)
            self._dropped.add(rid)
            return
        if failed:
            self._failed.add(rid)
        self._recved.add(rid)

    def _fail(self, job: LinkJob, exc: BaseException) -> None:
        # The request fails (kv_load_failure_policy="fail"); the engine wrapper then answers it
        # exactly by plain recomputation (VllmEngine.generate, AsyncVllmEngine.stream).
        logger.warning("MPIC: cannot link %s, failing it: %s", job.req_id, exc)
        with self._lock:
            self.stats["failed"] += 1
            if job.load_async:
                self._report(job, failed=True)
            else:
                self._failed_blocks.update(job.block_ids)

    def _decoding(self) -> bool:
        """A forward ran in the last 50 ms (requests are decoding)."""
        return time.perf_counter() - self._last_forward < 0.05

    def _link_all(self, ready: list[tuple[LinkJob, list[CacheEntry]]], paced: bool = False) -> None:
        """Link `ready` (`RequestLinker.link`); on the linking thread (`paced`) one layer at a
        time between vLLM's steps."""
        adapter: Any = self.adapter()
        if paced:
            pacer = self._pacer if self._pacer.share < 1 else None
            adapter = YieldingAdapter(adapter, self._model_lock, pacer)
        self._linker.link(ready, adapter, self._fail, self._linked, self._shift_last_query)

    def _shift_last_query(self, job: LinkJob, kv: PagedLinkedKV, plan: LinkPlan) -> None:
        """A corrected request's keys shifted for vLLM's forward of token N-1
        (`RequestLinker.link`): now when that forward is this step's, else in the step
        that schedules it."""
        if job.phase2 == "shift":
            with self._lock:
                self._to_shift[job.req_id] = (kv, plan.num_tokens - 1)
        elif kv.shift_for_last_query(plan.num_tokens - 1):  # vLLM's forward of token N-1
            self._shifted.append(kv)

    def _linked(
        self, jobs: list[LinkJob], began: float, outs: Sequence[LinkedPrefill] = ()
    ) -> None:
        """One link pass done (`outs`: its requests' outcomes, for the scouting counters)."""
        with self._lock:
            count_pass(self.stats, len(jobs), outs)
            for job in jobs:
                if job.load_async:
                    self._report(job, failed=False)
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
        """Async jobs linked or read ahead (finished receiving) or failed (also failed
        receiving) since the last call, and dropped jobs of ended requests (finished sending:
        blocks freed)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorTransferResults,
        )

        self._start_linking()  # the linking thread may have finished during the forward
        with self._lock:
            out = KVConnectorTransferResults(
                finished_sending=self._dropped,
                finished_recving=self._recved,
                failed_recving=self._failed,
            )
            self._dropped, self._recved, self._failed = set(), set(), set()
        return out

    def block_ids_with_load_errors(self) -> set[int]:
        """Blocks of sync jobs whose entries could not be loaded this step (then cleared)."""
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self) -> None:
        self._reads.shutdown()
        self._link_thread.shutdown(wait=True, cancel_futures=True)
