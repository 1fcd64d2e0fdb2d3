"""The tier list: the factory's order, a tier added without touching EntryStore, the list's
shape checked, promotion through every faster tier."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from mpic.storage.config import StorageConfig
from mpic.storage.entry_store import EntryStore
from mpic.storage.factory import TIERS, make_tiers
from mpic.storage.metrics import StoreMetrics
from mpic.storage.tiers.disk import DiskTier
from mpic.storage.tiers.memory import MemoryTier
from mpic.storage.tiers.object import ObjectTier
from mpic.storage.tiers.tier import Admitted, StorageTier, TierHit
from mpic.types import CacheEntry
from tests.storage.synthetic import assert_same, make_entry


class DictTier(StorageTier):
    """A blob tier in a dict: what a new tier costs (this class plus one list entry)."""

    name = "dict"

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.used = 0

    @classmethod
    def from_config(cls, cfg, objects) -> DictTier:  # noqa: ANN001
        return cls()

    def fetch(self, key: str, *, pin: bool = False) -> TierHit | None:
        from mpic.storage.entry_codec import decode

        blob = self.blobs.get(key)
        return None if blob is None else TierHit(decode(blob), len(blob), blob)

    def admit(self, key: str, entry: CacheEntry, blob: bytes, *, pin: bool = False) -> Admitted:
        self.blobs[key] = bytes(blob)
        self.used = sum(map(len, self.blobs.values()))
        return Admitted(entry, written=len(blob))

    def __contains__(self, key: str) -> bool:
        return key in self.blobs

    def discard(self, key: str) -> None:
        self.blobs.pop(key, None)


def test_factory_order(tmp_path) -> None:  # noqa: ANN001
    assert [t.name for t in TIERS] == ["memory", "disk", "object"]
    cfg = StorageConfig(url=f"file://{tmp_path}/o", fsync=False)
    assert [type(t) for t in make_tiers(cfg)] == [MemoryTier, ObjectTier]
    cfg = StorageConfig(url=f"file://{tmp_path}/o", disk_cache_dir=tmp_path / "d", fsync=False)
    assert [type(t) for t in make_tiers(cfg)] == [MemoryTier, DiskTier, ObjectTier]


def test_added_tier_serves_and_promotes(objects) -> None:  # noqa: ANN001
    extra = DictTier()
    metrics = StoreMetrics(CollectorRegistry())
    store = EntryStore.from_tiers([MemoryTier(1 << 30), extra, ObjectTier(objects)], metrics)
    entry = make_entry(0)
    key = store.put(entry)
    assert key in extra and store.locate(key) == "memory"
    assert metrics.value("mpic_store_written_bytes_total", tier="dict") == len(extra.blobs[key])
    store.memory.discard(key)
    got, tier = store.load(key)
    assert tier == "dict" and key in store.memory
    assert_same(got, entry)
    # another node: object hit promoted into the dict tier and memory
    other = EntryStore.from_tiers([MemoryTier(1 << 30), DictTier(), ObjectTier(objects)])
    got, tier = other.load(key)
    assert tier == "object" and key in other.tiers[1] and key in other.memory
    store.delete(key)
    assert key not in extra and store.locate(key) is None


def test_tier_list_shape(objects) -> None:  # noqa: ANN001
    with pytest.raises(ValueError):
        EntryStore.from_tiers([ObjectTier(objects)])
    with pytest.raises(ValueError):
        EntryStore.from_tiers([MemoryTier(1), DictTier()])
    with pytest.raises(ValueError):
        EntryStore.from_tiers([MemoryTier(1), ObjectTier(objects), ObjectTier(objects)])
