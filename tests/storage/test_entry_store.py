"""Tiered entry store: write-through, promotion, LRU by bytes, pins, metrics, corrupt copies."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from mpic.errors import CorruptEntryError
from mpic.storage.config import StorageConfig
from mpic.storage.entry_codec import encode
from mpic.storage.entry_store import EntryStore, entry_object_key
from mpic.storage.metrics import StoreMetrics
from mpic.storage.object_store import ObjectNotFoundError
from mpic.storage.tiers.disk import DiskTier
from mpic.storage.tiers.memory import entry_nbytes
from tests.storage.synthetic import assert_same, make_entry

E = [make_entry(i) for i in range(4)]
SIZE = entry_nbytes(E[0])
BLOB = len(encode(E[0]))


def _store(objects, tmp_path, mem_entries: float = 2.5, disk_entries: float = 2.5):  # noqa: ANN001, ANN202
    disk = DiskTier(tmp_path / "disk", int(BLOB * disk_entries))
    return EntryStore(
        objects,
        memory_bytes=int(SIZE * mem_entries),
        disk=disk,
        metrics=StoreMetrics(CollectorRegistry()),
    )


def test_write_through_and_promotion(objects, tmp_path) -> None:  # noqa: ANN001
    store = _store(objects, tmp_path)
    store.put(E[0])
    assert objects.exists(entry_object_key(E[0].entry_id))
    assert store.locate(E[0].entry_id) == "memory"
    # a second store on the same object store (another node) loads from the object tier
    other = _store(objects, tmp_path / "n2")
    entry, tier = other.load(E[0].entry_id)
    assert tier == "object"
    assert_same(entry, E[0])
    assert other.locate(E[0].entry_id) == "memory"
    assert E[0].entry_id in other.disk
    other.memory.discard(E[0].entry_id)
    assert other.load(E[0].entry_id)[1] == "disk"
    assert other.load(E[0].entry_id)[1] == "memory"
    m = other.metrics
    assert [m.value("mpic_store_hits_total", tier=t) for t in ("memory", "disk", "object")] == [
        1,
        1,
        1,
    ]
    assert m.value("mpic_store_misses_total", tier="memory") == 2
    assert m.value("mpic_store_read_bytes_total", tier="object") == BLOB
    assert m.value("mpic_store_load_seconds_count", tier="disk") == 1
    with pytest.raises(ObjectNotFoundError):
        other.get("0" * 64)
    assert m.value("mpic_store_misses_total", tier="object") == 1


def test_lru_by_bytes_and_pins(objects, tmp_path) -> None:  # noqa: ANN001
    store = _store(objects, tmp_path)
    store.put(E[0], pin=True)
    store.put(E[1])
    store.put(E[2])  # over capacity: E[1] (LRU, unpinned) goes, pinned E[0] stays
    assert E[0].entry_id in store.memory and E[1].entry_id not in store.memory
    assert store.memory.used == 2 * SIZE
    assert E[0].entry_id not in store.disk  # disk LRU evicted the oldest blob
    assert store.disk.used == 2 * BLOB
    store.unpin(E[0].entry_id)
    store.get(E[2].entry_id)
    store.put(E[3])
    assert E[0].entry_id not in store.memory  # unpinned and least recent now
    assert_same(store.get(E[0].entry_id), E[0])  # still durable in the object store


def test_pinned_context_releases_on_error(objects, tmp_path) -> None:  # noqa: ANN001
    store = _store(objects, tmp_path)
    store.put(E[0])
    with pytest.raises(ObjectNotFoundError):
        with store.pinned([E[0].entry_id, "f" * 64]):
            pass
    assert store.memory.pins(E[0].entry_id) == 0
    with store.pinned([E[0].entry_id]) as (entry,):
        assert store.memory.pins(E[0].entry_id) == 1
        assert_same(entry, E[0])
    assert store.memory.pins(E[0].entry_id) == 0


def test_corrupt_disk_copy_falls_through_to_object(objects, tmp_path) -> None:  # noqa: ANN001
    store = _store(objects, tmp_path)
    key = store.put(E[0])
    store.memory.discard(key)
    path = store.disk.store.path(key)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(data)
    entry, tier = store.load(key)
    assert tier == "object"
    assert_same(entry, E[0])
    assert store.metrics.value("mpic_store_fallbacks_total", reason="disk_corrupt") == 1


def test_corrupt_or_truncated_object_raises(objects, tmp_path) -> None:  # noqa: ANN001
    store = EntryStore(objects, memory_bytes=0)
    key = store.put(E[1])
    blob = encode(E[1])
    objects.put(entry_object_key(key), blob[: len(blob) // 2])
    with pytest.raises(CorruptEntryError):
        store.get(key)
    objects.put(entry_object_key(key), encode(E[2]))  # a valid entry under the wrong key
    with pytest.raises(CorruptEntryError):
        store.get(key)


def test_from_config(tmp_path) -> None:  # noqa: ANN001
    cfg = StorageConfig(
        url=f"file://{tmp_path}/o", disk_cache_dir=tmp_path / "d", memory_bytes=123, fsync=False
    )
    store = EntryStore.from_config(cfg, CollectorRegistry())
    assert store.memory.capacity == 123 and store.disk is not None
    key = store.put(E[0])
    assert (tmp_path / "o" / "entries" / key).is_file() and (tmp_path / "d" / key).is_file()
    with pytest.raises(ValueError):
        StorageConfig(url="file:///x", bogus=1)
