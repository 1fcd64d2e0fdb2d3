"""The tiered cache-entry store (the process that serves KV: Serve replica or vLLM worker).

Tiers, in lookup order (MPIC section 3.2: KV "on GPU memory, ... CPU memory or disks"; LMCache
v1's ordered tier list, `factory.TIERS`): memory (decoded entries, LRU by bytes, pinnable), local
disk (encoded blobs, LRU by bytes, optional) and the object store (durable, shared by every
node). The store only walks the list (`tier.StorageTier`): reads promote into the faster tiers;
writes go through to the durable tier first, so an entry is durable before any tier advertises
it. Every tier's hits, misses, bytes and latency are Prometheus metrics (`StoreMetrics`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry

from mpic.errors import CorruptEntryError
from mpic.storage.config import StorageConfig
from mpic.storage.entry_codec import encode
from mpic.storage.factory import make_tiers
from mpic.storage.keys import ENTRY_PREFIX, entry_object_key
from mpic.storage.metrics import StoreMetrics
from mpic.storage.object_store import ObjectNotFoundError, ObjectStore
from mpic.storage.tiers.disk import DiskTier
from mpic.storage.tiers.memory import MemoryTier
from mpic.storage.tiers.object import ObjectTier
from mpic.storage.tiers.tier import StorageTier
from mpic.types import CacheEntry

log = logging.getLogger(__name__)

Tier = str
"""A tier's name: "memory", "disk", "object" (`StorageTier.name`)."""
__all__ = ["ENTRY_PREFIX", "EntryStore", "entry_object_key"]


class EntryStore:
    """get / put / pin / locate / delete cache entries across an ordered list of tiers."""

    def __init__(
        self,
        objects: ObjectStore,
        *,
        memory_bytes: int = 2 << 30,
        disk: DiskTier | None = None,
        metrics: StoreMetrics | None = None,
    ) -> None:
        """The default tiers over `objects`: memory, `disk` if given, the object store."""
        tiers = [MemoryTier(memory_bytes), disk, ObjectTier(objects)]
        self._use([t for t in tiers if t is not None], metrics)

    @classmethod
    def from_tiers(
        cls, tiers: Sequence[StorageTier], metrics: StoreMetrics | None = None
    ) -> EntryStore:
        """A store over `tiers`, fastest first: a memory tier first, the durable tier last."""
        store = cls.__new__(cls)
        store._use(list(tiers), metrics)
        return store

    @classmethod
    def from_config(
        cls,
        cfg: StorageConfig,
        registry: CollectorRegistry | None = None,
        objects: ObjectStore | None = None,
    ) -> EntryStore:
        """Build the tiers `cfg` describes (the object store from its URL unless given)."""
        return cls.from_tiers(make_tiers(cfg, objects), StoreMetrics(registry))

    def _use(self, tiers: list[StorageTier], metrics: StoreMetrics | None) -> None:
        if not tiers or not isinstance(tiers[0], MemoryTier) or not tiers[-1].durable:
            raise ValueError("tiers must start with a memory tier and end with a durable one")
        if any(t.durable for t in tiers[:-1]):
            raise ValueError("only the last tier may be durable")
        self.tiers = tiers
        self.memory: MemoryTier = tiers[0]
        disks = [t for t in tiers if isinstance(t, DiskTier)]
        self.disk: DiskTier | None = disks[0] if disks else None
        durable = tiers[-1]
        self.objects: ObjectStore | None = getattr(durable, "objects", None)
        self.metrics = metrics or StoreMetrics()

    def put(self, entry: CacheEntry, *, pin: bool = False) -> str:
        """Write `entry` through every tier (durable first); returns its key (entry_id)."""
        key = entry.entry_id
        self._admit(key, entry, encode(entry), self.tiers, pin)
        return key

    def locate(self, key: str) -> Tier | None:
        """The fastest tier holding `key` now, or None (cheap: one stat on the object store)."""
        for tier in self.tiers:
            if key in tier:
                return tier.name
        return None

    def get(self, key: str, *, pin: bool = False) -> CacheEntry:
        """The verified entry from the fastest tier that has it, promoted into faster tiers.
        Raises ObjectNotFoundError (nowhere), CorruptEntryError (durable copy bad) or
        StoreUnavailableError (object store down)."""
        return self.load(key, pin=pin)[0]

    def load(self, key: str, *, pin: bool = False) -> tuple[CacheEntry, Tier]:
        """`get`, also naming the tier that served the entry."""
        m = self.metrics
        for i, tier in enumerate(self.tiers):
            t0 = time.perf_counter()
            try:
                hit = tier.fetch(key, pin=pin)
            except CorruptEntryError:
                if tier.durable:
                    raise
                m.fallbacks.labels(f"{tier.name}_corrupt").inc()
                hit = None
            if hit is None:
                m.misses.labels(tier.name).inc()
                continue
            m.hits.labels(tier.name).inc()
            if hit.nbytes is not None:
                m.bytes_read.labels(tier.name).inc(hit.nbytes)
            m.latency.labels(tier.name).observe(time.perf_counter() - t0)
            if i == 0:
                return hit.entry, tier.name
            faster = self.tiers[:i]
            if hit.blob is None and any(not isinstance(t, MemoryTier) for t in faster):
                blob = encode(hit.entry)
            else:
                blob = hit.blob
            return self._admit(key, hit.entry, blob, faster, pin), tier.name
        raise ObjectNotFoundError(entry_object_key(key))

    def _admit(
        self, key: str, entry: CacheEntry, blob: bytes, tiers: list[StorageTier], pin: bool
    ) -> CacheEntry:
        """Write into `tiers` slowest first; returns the copy the fastest one holds. A tier that
        drops the write only counts a fallback (`<tier>_write_failed`)."""
        for tier in reversed(tiers):
            done = tier.admit(key, entry, blob, pin=pin)
            entry = done.entry
            if done.written:
                self.metrics.bytes_written.labels(tier.name).inc(done.written)
            elif done.dropped:
                self.metrics.fallbacks.labels(f"{tier.name}_write_failed").inc()
        self._update_resident()
        return entry

    def _update_resident(self) -> None:
        for tier in self.tiers:
            if tier.used is not None:
                self.metrics.resident.labels(tier.name).set(tier.used)

    def unpin(self, key: str) -> None:
        """Release a pin taken by `get(pin=True)` / `put(pin=True)`."""
        for tier in self.tiers:
            tier.unpin(key)
        self._update_resident()

    @contextlib.contextmanager
    def pinned(self, keys: list[str]) -> Iterator[list[CacheEntry]]:
        """Load and pin `keys` for the duration of a request; unpins on exit (even on error)."""
        held: list[str] = []
        try:
            entries = []
            for key in keys:
                entries.append(self.get(key, pin=True))
                held.append(key)
            yield entries
        finally:
            for key in held:
                self.unpin(key)

    def delete(self, key: str) -> None:
        """Remove `key` from every tier, durable first (pinned memory copies live until
        unpinned)."""
        for tier in reversed(self.tiers):
            tier.discard(key)
        self._update_resident()
