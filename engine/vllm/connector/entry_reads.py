"""What loads a linked request's entries (vLLM worker process, the connector's worker half,
`mpic.engine.vllm.connector.worker`): reads from the tiered entry store (memory -> disk ->
object store, `mpic.storage.entry_store.EntryStore`) on a thread pool, one read per entry, all
entries of all async jobs in parallel, off the cores of vLLM's forward (`off_forward`), while
vLLM keeps stepping the running requests. A memory hit is read at once (it waits on nothing).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from mpic.engine.vllm.connector.link_job import LinkJob
from mpic.errors import MPICError
from mpic.storage.entry_store import EntryStore
from mpic.storage.object_store import ObjectNotFoundError
from mpic.types import CacheEntry

logger = logging.getLogger(__name__)

LOAD_ERRORS = (ObjectNotFoundError, MPICError, OSError, ValueError, KeyError, RuntimeError)
"""What a failed entry read or link raises (the request then falls back to recomputation)."""


LINK_NICE = 0
"""Nice value of the entry-read and linking threads: the CPU they share with vLLM's engine core
and front end goes to those first (a step waits on them; a linked request only on its link)."""


def off_forward(main_cpus: set[int]) -> set[int]:
    """Move the calling (read or linking) thread off the cores of vLLM's forward (`main_cpus`),
    at a low priority (nice `LINK_NICE`, this thread only): vLLM
    binds its forward's OpenMP threads to a core list and leaves the rest to its other
    processes, and a thread inherits its creator's binding, so without this the entry
    reads and the linking would run on the forward's core. Returns the cores it moved to
    (empty where vLLM took every core: the thread then shares them)."""
    try:  # below vLLM's engine core and front end, which share the free cores
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LINK_NICE)
    except OSError as exc:
        logger.info("MPIC: %s keeps its priority (%s)", threading.current_thread().name, exc)
    others = set(range(os.cpu_count() or 1)) - main_cpus
    if not main_cpus or not others:
        return set()
    try:
        os.sched_setaffinity(0, others)
    except OSError as exc:
        logger.info("MPIC: %s keeps vLLM's cores (%s)", threading.current_thread().name, exc)
        return set()
    return others


@dataclasses.dataclass
class Loading:
    """An async job whose entries are being read."""

    job: LinkJob
    reads: dict[str, Future]
    began: float


@dataclasses.dataclass
class Loaded:
    """An async job whose reads are over: its entries in plan order, or the read's error."""

    job: LinkJob
    entries: list[CacheEntry]
    error: BaseException | None
    began: float
    """When its reads started (`time.perf_counter`)."""
    reads: int
    """Entries read (each distinct entry once)."""


class EntryReads:
    """The async jobs' entry reads (module docstring).

    store: the entry store (made on first use); fetch_threads: reads in flight at once (all
    jobs together); main_cpus: the cores of vLLM's forward, known once the runner is attached."""

    def __init__(
        self,
        store: Callable[[], EntryStore],
        fetch_threads: int,
        main_cpus: Callable[[], set[int]],
    ) -> None:
        self._store = store
        self._main_cpus = main_cpus
        self._pool = ThreadPoolExecutor(
            fetch_threads, thread_name_prefix="mpic-entry-read", initializer=self._off_forward
        )
        self.loading: dict[str, Loading] = {}

    def _off_forward(self) -> None:
        off_forward(self._main_cpus())

    def start(self, job: LinkJob) -> None:
        """Start reading the job's entries (memory hits at once, the others on the pool)."""
        store = self._store()
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
        self.loading[job.req_id] = Loading(job, reads, time.perf_counter())

    def finished(self) -> Iterator[Loaded]:
        """The jobs whose reads are all over (each once), in the order they were started."""
        for rid, loading in list(self.loading.items()):
            if not all(r.done() for r in loading.reads.values()):
                continue
            del self.loading[rid]
            try:
                got = {e: r.result() for e, r in loading.reads.items()}
            except LOAD_ERRORS as exc:
                yield Loaded(loading.job, [], exc, loading.began, len(loading.reads))
                continue
            entries = [got[e] for e in loading.job.entry_ids]
            yield Loaded(loading.job, entries, None, loading.began, len(loading.reads))

    def cancel(self, rid: str) -> bool:
        """Stop reading a job's entries (its request ended); False: it was not being read."""
        loading = self.loading.pop(rid, None)
        if loading is None:
            return False
        for read in loading.reads.values():
            read.cancel()
        return True

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
