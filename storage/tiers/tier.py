"""The storage tier interface (process that owns the entry store: Serve replica or vLLM worker).

`EntryStore` walks an ordered list of tiers, fastest first, and knows nothing else about them
(as LMCache v1's `StorageBackendInterface`): a read asks each tier in turn and promotes a hit
into the faster tiers; a write goes through the tiers slowest (durable) first. A new tier is one
file in this folder with a `StorageTier` subclass and one line in `mpic.storage.factory.TIERS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:  # mpic.types imports torch; the HTTP processes stay torch-free
    from mpic.storage.config import StorageConfig
    from mpic.storage.object_store import ObjectStore
    from mpic.types import CacheEntry


@dataclass(frozen=True)
class TierHit:
    """An entry served by a tier: its verified entry, the bytes read (None: nothing was read, as
    for decoded entries in memory) and the encoded blob when the tier had it (for promotion into
    blob tiers)."""

    entry: CacheEntry
    nbytes: int | None = None
    blob: bytes | bytearray | memoryview | None = None


@dataclass(frozen=True)
class Admitted:
    """What a tier did with a written entry: the copy it now holds (a resident copy wins, so two
    loaders of one key share tensors), bytes written, and whether it dropped a write it should
    have taken (a full disk: counted as the `<tier>_write_failed` fallback)."""

    entry: CacheEntry
    written: int = 0
    dropped: bool = False


class StorageTier(ABC):
    """One level of the entry store. Keys are entry ids."""

    name: ClassVar[str]
    """Label of the tier in metrics and in `EntryStore.locate` / `load`."""
    durable: ClassVar[bool] = False
    """The tier of record: its corrupt copies and outages raise instead of falling through."""
    used: int | None = None
    """Resident bytes (the `mpic_store_resident_bytes{tier}` gauge), None when not tracked."""

    @classmethod
    @abstractmethod
    def from_config(cls, cfg: StorageConfig, objects: ObjectStore) -> StorageTier | None:
        """The tier `cfg` asks for, or None when `cfg` disables it."""

    @abstractmethod
    def fetch(self, key: str, *, pin: bool = False) -> TierHit | None:
        """The verified entry, or None when absent. A non-durable tier raises CorruptEntryError
        after dropping a bad copy (the next tier then serves)."""

    @abstractmethod
    def admit(self, key: str, entry: CacheEntry, blob: bytes, *, pin: bool = False) -> Admitted:
        """Take `entry` (and its encoded `blob`) in; pins apply to tiers that hold entries."""

    @abstractmethod
    def __contains__(self, key: str) -> bool:
        """Whether the tier holds `key` now (a cheap check)."""

    @abstractmethod
    def discard(self, key: str) -> None:
        """Forget `key` (pinned copies live until their last unpin)."""

    def unpin(self, key: str) -> None:  # noqa: B027 - only entry-holding tiers pin
        """Release a pin taken by `fetch(pin=True)` / `admit(pin=True)`."""
