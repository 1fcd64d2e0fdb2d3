"""Local disk tier: encoded entry blobs in a local folder, LRU by bytes (process that owns the
store: Serve replica or vLLM worker; one folder per node).

Files are written atomically through `FileSystemObjectStore` (temp + os.replace). Large files
are read by memory-mapping them privately and decoding in place: the XXH3 checksum pass
(entry_codec) pulls the pages in (MADV_SEQUENTIAL readahead) and the tensors view the mapping,
so a load costs one fast hash pass and no copy. Each mapping holds one file descriptor while its
entry lives (at most memory_bytes / 8 MiB of them in the memory tier); `torch.from_file` keeps
none but measured 20-25% slower on cold reads. Small files are read
with one read() (mapping them would cost a page-fault round trip per readahead window). The LRU
index is rebuilt from file mtimes at start-up. A corrupt file is deleted on sight; the next tier
then serves the entry. A failed write (disk full) is dropped, never raised: the tier degrades to
the object store and leaves no partial file behind.
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

from mpic.errors import CorruptEntryError
from mpic.storage.fs_store import FileSystemObjectStore
from mpic.storage.object_store import ObjectNotFoundError
from mpic.storage.tiers.tier import Admitted, StorageTier, TierHit

if TYPE_CHECKING:  # mpic.types imports torch; the HTTP processes stay torch-free
    from mpic.storage.config import StorageConfig
    from mpic.storage.object_store import ObjectStore
    from mpic.types import CacheEntry

log = logging.getLogger(__name__)

_MAP_MIN = 8 << 20
"""Files at least this large are memory-mapped instead of read."""


class DiskTier(StorageTier):
    """LRU-by-bytes cache of entry blobs under `root` (keys are entry keys)."""

    name = "disk"

    def __init__(self, root: Path, capacity_bytes: int, *, fsync: bool = False) -> None:
        self.store = FileSystemObjectStore(root, fsync=fsync)
        self.capacity = capacity_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()
        found = [self.store.stat(k) for k in self.store.list()]
        for info in sorted(found, key=lambda i: i.mtime):
            self._index[info.key] = info.size
        self.used = sum(self._index.values())
        self.evicted = 0
        self.write_errors = 0
        self.store.clean_tmp(older_than_s=0.0)

    @classmethod
    def from_config(cls, cfg: StorageConfig, objects: ObjectStore) -> DiskTier | None:
        if cfg.disk_cache_dir is None:
            return None
        return cls(cfg.disk_cache_dir, cfg.disk_bytes)

    def fetch(self, key: str, *, pin: bool = False) -> TierHit | None:
        found = self.get(key)
        return None if found is None else TierHit(found[0], found[1])

    def admit(self, key: str, entry: CacheEntry, blob: bytes, *, pin: bool = False) -> Admitted:
        """A full or failing disk drops the write (`dropped`): the entry stays durable in the
        object store."""
        if self.put(key, blob):
            return Admitted(entry, written=len(blob))
        return Admitted(entry, dropped=len(blob) <= self.capacity)

    def get(self, key: str) -> tuple[CacheEntry, int] | None:
        """(verified entry, blob bytes), or None if absent; CorruptEntryError after deleting a
        bad file."""
        with self._lock:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        try:
            blob = self._read(key)
        except ObjectNotFoundError:
            self._forget(key)
            return None
        try:
            # the codec needs torch: imported on first read, so the HTTP processes that build
            # the store's tiers stay torch-free
            from mpic.storage.entry_codec import decode

            return decode(blob, check="xxh3_128"), len(blob)
        except CorruptEntryError:
            log.warning("disk tier: corrupt entry %s deleted", key)
            self.discard(key)
            raise

    def _read(self, key: str) -> bytearray | mmap.mmap:
        """Small files in one read() into a fresh buffer (one I/O, no page-fault round trips);
        large ones memory-mapped (no copy)."""
        stream = self.store.open_read(key)
        try:
            if stream.size >= _MAP_MIN:
                return self.store.map_read(key)
            buf = bytearray(stream.size)
            view, got = memoryview(buf), 0
            while got < len(buf) and (n := stream.readinto(view[got:])):
                got += n
            return buf[:got] if got < len(buf) else buf
        finally:
            stream.close()

    def put(self, key: str, blob: bytes) -> bool:
        """Store `blob` (atomic), then evict LRU files until the tier fits. False when the tier
        cannot take it (larger than the tier, or the disk is full / failing: the write is dropped,
        its temp file removed, and callers keep serving from the object store)."""
        if len(blob) > self.capacity:
            return False
        try:
            self.store.put(key, blob)
        except OSError as exc:  # ENOSPC, EDQUOT, EIO: degrade, never fail the caller
            self.write_errors += 1
            log.warning(
                "disk tier: cannot write %s (%s); serving from the object store",
                key,
                exc.strerror or type(exc).__name__,
            )
            return False
        with self._lock:
            self.used += len(blob) - self._index.pop(key, 0)
            self._index[key] = len(blob)
            victims = []
            while self.used > self.capacity and self._index:
                victim, size = self._index.popitem(last=False)
                self.used -= size
                victims.append(victim)
        for victim in victims:
            self.store.delete(victim)
            self.evicted += 1
        return True

    def _forget(self, key: str) -> None:
        with self._lock:
            self.used -= self._index.pop(key, 0)

    def discard(self, key: str) -> None:
        """Delete `key`'s file if present."""
        self._forget(key)
        self.store.delete(key)

    def keys(self) -> list[str]:
        """The resident keys, least recent first (a snapshot)."""
        with self._lock:
            return list(self._index)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._index
