"""The object-store tier: the durable, shared copy of every entry, last in lookup order
(process that owns the entry store: Serve replica or vLLM worker).

Reads stream the blob and verify it (`entry_codec.read_entry`, BLAKE3); a blob holding another
entry is corrupt. Absence is None; an unreachable store raises StoreUnavailableError.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mpic.errors import CorruptEntryError
from mpic.storage.config import StorageConfig
from mpic.storage.keys import entry_object_key
from mpic.storage.object_store import ObjectNotFoundError, ObjectStore
from mpic.storage.tiers.tier import Admitted, StorageTier, TierHit

if TYPE_CHECKING:  # mpic.types imports torch; the HTTP processes stay torch-free
    from mpic.types import CacheEntry


class ObjectTier(StorageTier):
    """Entries under `entries/<id>` of an ObjectStore (filesystem or S3)."""

    name = "object"
    durable = True

    def __init__(self, objects: ObjectStore) -> None:
        self.objects = objects

    @classmethod
    def from_config(cls, cfg: StorageConfig, objects: ObjectStore) -> ObjectTier:
        return cls(objects)

    def fetch(self, key: str, *, pin: bool = False) -> TierHit | None:
        try:
            stream = self.objects.open_read(entry_object_key(key))
        except ObjectNotFoundError:
            return None
        try:
            # the codec needs torch: imported on first read, so the HTTP processes that build
            # the store's tiers stay torch-free
            from mpic.storage.entry_codec import read_entry

            entry, blob = read_entry(stream)
        finally:
            stream.close()
        if entry.entry_id != key:
            raise CorruptEntryError(f"object {key} holds entry {entry.entry_id}")
        return TierHit(entry, len(blob), blob)

    def admit(self, key: str, entry: CacheEntry, blob: bytes, *, pin: bool = False) -> Admitted:
        self.objects.put(entry_object_key(key), blob)
        return Admitted(entry, written=len(blob))

    def __contains__(self, key: str) -> bool:
        return self.objects.exists(entry_object_key(key))

    def discard(self, key: str) -> None:
        self.objects.delete(entry_object_key(key))
