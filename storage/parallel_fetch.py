"""Parallel KV fetch with recomputation of misses (MPIC section 3.2, Fig. 6). Runs in the process
that prepares a linked prompt (the linker / MPIC connector side).

For the n entry keys of a link plan: memory hits are served at once; every other key is loaded on
a thread pool from whichever tier holds it (disk, object store). A key that is missing (expired,
evicted), corrupt (checksum), unreachable (server down) or slower than `load_timeout_s` is handed
to the `compute` callback, which runs concurrently with the remaining loads ("the computation and
transfer of KV caches are executed concurrently"; "in the case of failures when loading KV caches
from disks, MPIC will continue to calculate all KV caches and keep serving"). Every fallback is
counted (`mpic_store_fallbacks{reason}`) and logged. The caller gets every entry or `FetchError`;
entries are checksum-verified by the codec and must carry the requested key, so a wrong entry is
never returned.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from mpic.errors import CorruptEntryError, MPICError
from mpic.storage.entry_store import EntryStore
from mpic.storage.object_store import ObjectNotFoundError, StoreUnavailableError
from mpic.types import CacheEntry

log = logging.getLogger(__name__)


class FetchError(MPICError):
    """An entry could be neither loaded nor recomputed (HTTP 500)."""

    code = "kv_fetch_failed"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ObjectNotFoundError):
        return "missing"
    if isinstance(exc, CorruptEntryError):
        return "corrupt"
    if isinstance(exc, StoreUnavailableError):
        return "unavailable"
    return "error"


@dataclass
class FetchResult:
    """Entries aligned with the requested keys, where each came from, and what fell back."""

    entries: list[CacheEntry]
    sources: list[str]
    """Per requested key: 'memory', 'disk', 'object' or 'computed'."""
    fallbacks: dict[str, str] = field(default_factory=dict)
    """key -> reason ('missing', 'corrupt', 'unavailable', 'timeout', 'error')."""
    _store: EntryStore | None = None
    _pinned: list[str] = field(default_factory=list)

    def release(self) -> None:
        """Unpin the entries pinned by `fetch_entries(pin=True)`."""
        for key in self._pinned:
            assert self._store is not None
            self._store.unpin(key)
        self._pinned.clear()

    def __enter__(self) -> FetchResult:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def fetch_entries(
    store: EntryStore,
    keys: Sequence[str],
    compute: Callable[[str], CacheEntry],
    *,
    max_workers: int = 4,
    compute_workers: int = 1,
    load_timeout_s: float = 30.0,
    store_computed: bool = True,
    pin: bool = False,
) -> FetchResult:
    """Load or recompute every key of `keys` (duplicates allowed) concurrently. `compute(key)`
    must return the entry for `key`; recomputed entries are written back when `store_computed`.
    With `pin`, every returned entry resident in memory stays pinned until `release()`."""
    unique = list(dict.fromkeys(keys))
    got: dict[str, CacheEntry] = {}
    source: dict[str, str] = {}
    result = FetchResult([], [], _store=store)
    loads = ThreadPoolExecutor(max_workers, thread_name_prefix="mpic-load")
    computes = ThreadPoolExecutor(compute_workers, thread_name_prefix="mpic-compute")
    pending: dict[Future, tuple[str, str]] = {}

    def fall_back(key: str, reason: str) -> None:
        result.fallbacks[key] = reason
        store.metrics.fallbacks.labels(reason).inc()
        log.info("entry %s: %s, recomputing", key, reason)
        pending[computes.submit(_compute, store, key, compute, store_computed, pin)] = (
            key,
            "compute",
        )

    try:
        for key in unique:
            entry = store.memory.get(key, pin=pin)
            if entry is not None:
                store.metrics.hits.labels("memory").inc()
                got[key], source[key] = entry, "memory"
                result._pinned += [key] if pin else []
            else:
                pending[loads.submit(_load, store, key, pin)] = (key, "load")
        deadline = time.monotonic() + load_timeout_s
        while pending:
            loading = [f for f, (_, kind) in pending.items() if kind == "load"]
            timeout = max(0.0, deadline - time.monotonic()) if loading else None
            done, _ = wait(list(pending), timeout=timeout, return_when=FIRST_COMPLETED)
            if not done:  # every remaining load is past the deadline
                for f in loading:
                    key = pending.pop(f)[0]
                    f.add_done_callback(_unpin_late(store, key, pin))
                    fall_back(key, "timeout")
                continue
            for f in done:
                key, kind = pending.pop(f)
                try:
                    entry, where, pinned = f.result()
                except Exception as e:  # noqa: BLE001 - any load failure falls back
                    if kind == "compute":
                        raise FetchError(f"recomputing entry {key} failed: {e}") from e
                    fall_back(key, _reason(e))
                    continue
                got[key], source[key] = entry, where
                result._pinned += [key] if pinned else []
    except BaseException:
        result.release()
        raise
    finally:
        loads.shutdown(wait=False, cancel_futures=True)
        computes.shutdown(wait=False, cancel_futures=True)
    result.entries = [got[k] for k in keys]
    result.sources = [source[k] for k in keys]
    return result


def _load(store: EntryStore, key: str, pin: bool) -> tuple[CacheEntry, str, bool]:
    entry, where = store.load(key, pin=pin)
    if entry.entry_id != key:
        if pin:
            store.unpin(key)
        store.delete(key)
        raise CorruptEntryError(f"stored entry {key} holds {entry.entry_id}")
    return entry, where, pin


def _compute(
    store: EntryStore,
    key: str,
    compute: Callable[[str], CacheEntry],
    store_computed: bool,
    pin: bool,
) -> tuple[CacheEntry, str, bool]:
    entry = compute(key)
    if entry.entry_id != key:
        raise FetchError(f"compute callback returned entry {entry.entry_id} for {key}")
    if store_computed:
        try:
            store.put(entry, pin=pin)
            return entry, "computed", pin
        except (StoreUnavailableError, OSError) as e:
            log.warning("entry %s recomputed but not stored: %s", key, e)
    return entry, "computed", False


def _unpin_late(store: EntryStore, key: str, pin: bool) -> Callable[[Future], None]:
    """A timed-out load that finishes later must not leave its pin behind."""

    def done(f: Future) -> None:
        if pin and f.exception() is None:
            store.unpin(key)

    return done
