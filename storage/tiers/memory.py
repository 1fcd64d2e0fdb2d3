"""Memory tier: decoded CacheEntry objects in an LRU bounded by bytes, with pins (process that
owns the store: Serve replica or vLLM worker).

An entry pinned by a running request is never evicted; `discard` of a pinned entry (its file
expired) hides it from new lookups at once and frees it when the last pin is released, so a
request that started before the expiry finishes with intact KV (MPIC section 3.1, step 1:
"subsequently deleted following the expiration of their designated timeframe").
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mpic.storage.tiers.tier import Admitted, StorageTier, TierHit

if TYPE_CHECKING:  # mpic.types imports torch; the HTTP processes stay torch-free
    from mpic.storage.config import StorageConfig
    from mpic.storage.object_store import ObjectStore
    from mpic.types import CacheEntry

log = logging.getLogger(__name__)


def entry_nbytes(entry: CacheEntry) -> int:
    """Bytes held by an entry's tensors."""
    ts = (entry.keys, entry.values, entry.positions, entry.input_embeds)
    return sum(t.numel() * t.element_size() for t in ts)


@dataclass
class _Slot:
    entry: CacheEntry
    nbytes: int
    pins: int = 0
    doomed: bool = False


class MemoryTier(StorageTier):
    """LRU by bytes over decoded entries; thread-safe."""

    name = "memory"

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self._slots: OrderedDict[str, _Slot] = OrderedDict()
        self._doomed: dict[str, _Slot] = {}
        self._lock = threading.Lock()
        self.used = 0
        self.evicted = 0

    @classmethod
    def from_config(cls, cfg: StorageConfig, objects: ObjectStore) -> MemoryTier:
        return cls(cfg.memory_bytes)

    def fetch(self, key: str, *, pin: bool = False) -> TierHit | None:
        entry = self.get(key, pin=pin)
        return None if entry is None else TierHit(entry)

    def admit(self, key: str, entry: CacheEntry, blob: bytes, *, pin: bool = False) -> Admitted:
        return Admitted(self.put(key, entry, pin=pin))

    def get(self, key: str, *, pin: bool = False) -> CacheEntry | None:
        """The entry (marked most recent, pinned if asked), or None."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                return None
            self._slots.move_to_end(key)
            slot.pins += int(pin)
            return slot.entry

    def put(self, key: str, entry: CacheEntry, *, pin: bool = False) -> CacheEntry:
        """Insert (or refresh) `key`; returns the resident entry (an existing one wins, so two
        loaders of one key share tensors). Evicts unpinned LRU entries to fit."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                slot = _Slot(entry, entry_nbytes(entry))
                self._slots[key] = slot
                self.used += slot.nbytes
            self._slots.move_to_end(key)
            slot.pins += int(pin)
            self._evict()
            return slot.entry

    def _evict(self) -> None:
        for key in list(self._slots):
            if self.used <= self.capacity:
                return
            slot = self._slots[key]
            if slot.pins == 0:
                del self._slots[key]
                self.used -= slot.nbytes
                self.evicted += 1
        if self.used > self.capacity:
            log.warning(
                "memory tier over capacity (%d > %d bytes): all entries pinned",
                self.used,
                self.capacity,
            )

    def unpin(self, key: str) -> None:
        """Release one pin; frees a discarded entry when its last pin goes."""
        with self._lock:
            slot = self._slots.get(key) or self._doomed.get(key)
            if slot is None or slot.pins == 0:
                raise RuntimeError(f"unpin of {key} without a pin")
            slot.pins -= 1
            if slot.doomed and slot.pins == 0:
                del self._doomed[key]
                self.used -= slot.nbytes
            self._evict()

    def discard(self, key: str) -> None:
        """Forget `key`; if pinned, keep its memory until the last unpin."""
        with self._lock:
            slot = self._slots.pop(key, None)
            if slot is None:
                return
            if slot.pins:
                slot.doomed = True
                self._doomed[key] = slot
            else:
                self.used -= slot.nbytes

    def keys(self) -> list[str]:
        """The resident keys, least recent first (a snapshot)."""
        with self._lock:
            return list(self._slots)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._slots

    def pins(self, key: str) -> int:
        """Current pin count of `key` (0 if absent)."""
        with self._lock:
            slot = self._slots.get(key) or self._doomed.get(key)
            return slot.pins if slot else 0
