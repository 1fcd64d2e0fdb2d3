"""The tiered cache-entry store (the process that serves KV: Serve replica or vLLM worker).

Tiers, in lookup order (MPIC section 3.2: KV "on GPU memory, ... CPU memory or disks"; LMCache
v1's ordered tier list): memory (decoded entries, LRU by bytes, pinnable), local disk (encoded
blobs, LRU by bytes, optional) and the object store (durable, shared by every node). Reads
promote into the faster tiers; writes go through to the object store first, so an entry is
durable before any tier advertises it. Every tier's hits, misses, bytes and latency are
Prometheus metrics (`StoreMetrics`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Literal

from prometheus_client import CollectorRegistry

from mpic.errors import CorruptEntryError
from mpic.storage.config import StorageConfig
from mpic.storage.disk_tier import DiskTier
from mpic.storage.entry_codec import encode, read_entry
from mpic.storage.factory import make_object_store
from mpic.storage.keys import ENTRY_PREFIX, entry_object_key
from mpic.storage.memory_tier import MemoryTier
from mpic.storage.metrics import StoreMetrics
from mpic.storage.object_store import ObjectNotFoundError, ObjectStore
from mpic.types import CacheEntry

log = logging.getLogger(__name__)

Tier = Literal["memory", "disk", "object"]
__all__ = ["ENTRY_PREFIX", "EntryStore", "entry_object_key"]


class EntryStore:
    """get / put / pin / locate / delete cache entries across memory, disk and object tiers."""

    def __init__(
        self,
        objects: ObjectStore,
        *,
        memory_bytes: int = 2 << 30,
        disk: DiskTier | None = None,
        metrics: StoreMetrics | None = None,
    ) -> None:
        self.objects = objects
        self.memory = MemoryTier(memory_bytes)
        self.disk = disk
        self.metrics = metrics or StoreMetrics()

    @classmethod
    def from_config(
        cls,
        cfg: StorageConfig,
        registry: CollectorRegistry | None = None,
        objects: ObjectStore | None = None,
    ) -> EntryStore:
        """Build the tiers `cfg` describes (the object store from its URL unless given)."""
        disk = (
            DiskTier(cfg.disk_cache_dir, cfg.disk_bytes) if cfg.disk_cache_dir is not None else None
        )
        return cls(
            objects or make_object_store(cfg),
            memory_bytes=cfg.memory_bytes,
            disk=disk,
            metrics=StoreMetrics(registry),
        )

    def put(self, entry: CacheEntry, *, pin: bool = False) -> str:
        """Write `entry` through every tier (object store first); returns its key (entry_id)."""
        key = entry.entry_id
        blob = encode(entry)
        self.objects.put(entry_object_key(key), blob)
        self.metrics.bytes_written.labels("object").inc(len(blob))
        if self.disk is not None:
            self._disk_put(key, blob)
        self.memory.put(key, entry, pin=pin)
        self._update_resident()
        return key

    def locate(self, key: str) -> Tier | None:
        """The fastest tier holding `key` now, or None (cheap: one stat on the object store)."""
        if key in self.memory:
            return "memory"
        if self.disk is not None and key in self.disk:
            return "disk"
        return "object" if self.objects.exists(entry_object_key(key)) else None

    def get(self, key: str, *, pin: bool = False) -> CacheEntry:
        """The verified entry from the fastest tier that has it, promoted into faster tiers.
        Raises ObjectNotFoundError (nowhere), CorruptEntryError (durable copy bad) or
        StoreUnavailableError (object store down)."""
        return self.load(key, pin=pin)[0]

    def load(self, key: str, *, pin: bool = False) -> tuple[CacheEntry, Tier]:
        """`get`, also naming the tier that served the entry."""
        m = self.metrics
        t0 = time.perf_counter()
        entry = self.memory.get(key, pin=pin)
        if entry is not None:
            m.hits.labels("memory").inc()
            m.latency.labels("memory").observe(time.perf_counter() - t0)
            return entry, "memory"
        m.misses.labels("memory").inc()
        if self.disk is not None:
            t0 = time.perf_counter()
            try:
                found = self.disk.get(key)
            except CorruptEntryError:
                m.fallbacks.labels("disk_corrupt").inc()
                found = None
            if found is not None:
                entry, size = found
                self._record_load("disk", size, t0)
                return self._promote(key, entry, pin), "disk"
            m.misses.labels("disk").inc()
        t0 = time.perf_counter()
        try:
            stream = self.objects.open_read(entry_object_key(key))
        except ObjectNotFoundError:
            m.misses.labels("object").inc()
            raise
        try:
            entry, blob = read_entry(stream)
        finally:
            stream.close()
        if entry.entry_id != key:
            raise CorruptEntryError(f"object {key} holds entry {entry.entry_id}")
        self._record_load("object", len(blob), t0)
        if self.disk is not None:
            self._disk_put(key, blob)
        return self._promote(key, entry, pin), "object"

    def _disk_put(self, key: str, blob: bytes) -> None:
        """Write through to the disk tier; a full or failing disk only counts a fallback
        (`disk_write_failed`): the entry stays durable in the object store."""
        if self.disk.put(key, blob):
            self.metrics.bytes_written.labels("disk").inc(len(blob))
        elif len(blob) <= self.disk.capacity:
            self.metrics.fallbacks.labels("disk_write_failed").inc()

    def _record_load(self, tier: Tier, size: int, t0: float) -> None:
        self.metrics.hits.labels(tier).inc()
        self.metrics.bytes_read.labels(tier).inc(size)
        self.metrics.latency.labels(tier).observe(time.perf_counter() - t0)

    def _promote(self, key: str, entry: CacheEntry, pin: bool) -> CacheEntry:
        entry = self.memory.put(key, entry, pin=pin)
        self._update_resident()
        return entry

    def _update_resident(self) -> None:
        self.metrics.resident.labels("memory").set(self.memory.used)
        if self.disk is not None:
            self.metrics.resident.labels("disk").set(self.disk.used)

    def unpin(self, key: str) -> None:
        """Release a pin taken by `get(pin=True)` / `put(pin=True)`."""
        self.memory.unpin(key)
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
        """Remove `key` from every tier (pinned memory copies live until unpinned)."""
        self.objects.delete(entry_object_key(key))
        if self.disk is not None:
            self.disk.discard(key)
        self.memory.discard(key)
        self._update_resident()
