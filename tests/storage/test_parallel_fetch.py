"""Parallel fetch (MPIC section 3.2, Fig. 6): hits load from every tier while misses recompute at
the same time; every failed load (missing, corrupt, server down or cut mid-read, hung) falls back
to recomputation, is counted, and the caller always gets the exact entries."""

from __future__ import annotations

import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from mpic.storage.entry_codec import encode
from mpic.storage.entry_store import EntryStore, entry_object_key
from mpic.storage.metrics import StoreMetrics
from mpic.storage.parallel_fetch import FetchError, fetch_entries
from mpic.storage.s3_store import S3ObjectStore
from mpic.storage.tiers.disk import DiskTier
from tests.fixtures.s3 import CuttingProxy
from tests.storage.synthetic import assert_same, make_entry

E = {e.entry_id: e for e in (make_entry(i, tokens=64) for i in range(6))}
K = list(E)


class Recompute:
    """The compute callback: exact recomputation (here: the reference entry), timed."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay, self.calls, self.started = delay, [], {}
        self._t0 = time.monotonic()
        self._lock = threading.Lock()

    def __call__(self, key: str):  # noqa: ANN204
        with self._lock:
            self.calls.append(key)
            self.started[key] = time.monotonic() - self._t0
        time.sleep(self.delay)
        return make_entry(K.index(key), tokens=64)


def _store(objects, tmp_path) -> EntryStore:  # noqa: ANN001
    return EntryStore(
        objects,
        memory_bytes=1 << 24,
        disk=DiskTier(tmp_path / "d", 1 << 24),
        metrics=StoreMetrics(CollectorRegistry()),
    )


def _check(result, keys) -> None:  # noqa: ANN001
    assert len(result.entries) == len(keys)
    for key, entry in zip(keys, result.entries, strict=True):
        assert_same(entry, E[key])


def test_every_tier_and_misses(objects, tmp_path) -> None:  # noqa: ANN001
    store = _store(objects, tmp_path)
    for k in K[:4]:
        store.put(E[k])
    store.memory.discard(K[1])  # K1: disk; K2: object only; K3: memory; K0: memory
    store.memory.discard(K[2])
    store.disk.discard(K[2])
    keys = [K[0], K[1], K[2], K[4], K[0], K[5]]  # K4, K5 never stored; K0 twice
    compute = Recompute()
    result = fetch_entries(store, keys, compute)
    _check(result, keys)
    assert result.sources == ["memory", "disk", "object", "computed", "memory", "computed"]
    assert sorted(compute.calls) == sorted([K[4], K[5]])
    assert result.fallbacks == {K[4]: "missing", K[5]: "missing"}
    assert store.metrics.value("mpic_store_fallbacks_total", reason="missing") == 2
    assert objects.exists(entry_object_key(K[4]))  # recomputed entries are written back
    again = fetch_entries(store, keys, Recompute())
    assert set(again.sources) == {"memory"} and again.fallbacks == {}


def test_corrupt_and_truncated_objects_recomputed_and_healed(objects, tmp_path) -> None:  # noqa: ANN001
    store = EntryStore(objects, memory_bytes=0, metrics=StoreMetrics(CollectorRegistry()))
    for k in K[:3]:
        store.put(E[k])
    blob = bytearray(encode(E[K[0]]))
    blob[len(blob) // 2] ^= 1
    objects.put(entry_object_key(K[0]), blob)
    objects.put(entry_object_key(K[1]), blob[:100])
    objects.put(entry_object_key(K[2]), encode(E[K[3]]))  # valid entry, wrong key
    result = fetch_entries(store, K[:3], Recompute())
    _check(result, K[:3])
    assert result.fallbacks == {K[0]: "corrupt", K[1]: "corrupt", K[2]: "corrupt"}
    assert store.metrics.value("mpic_store_fallbacks_total", reason="corrupt") == 3
    healed = fetch_entries(store, K[:3], Recompute())
    assert healed.sources == ["object"] * 3 and healed.fallbacks == {}


def test_server_down_falls_back(s3_server, tmp_path) -> None:  # noqa: ANN001
    store = EntryStore(
        S3ObjectStore(s3_server.config()), memory_bytes=0, metrics=StoreMetrics(CollectorRegistry())
    )
    for k in K[:4]:
        store.put(E[k])
    with s3_server.down():
        result = fetch_entries(store, K[:4], Recompute())
    _check(result, K[:4])
    assert set(result.fallbacks.values()) == {"unavailable"} and len(result.fallbacks) == 4
    assert fetch_entries(store, K[:4], Recompute()).sources == ["object"] * 4


def test_server_cut_mid_read_falls_back(s3_server) -> None:  # noqa: ANN001
    direct = S3ObjectStore(s3_server.config())
    cfg = s3_server.config(bucket=direct.cfg.bucket)
    for k in K[:3]:
        EntryStore(direct, memory_bytes=0).put(E[k])
    proxy = CuttingProxy(s3_server.port, limit=len(encode(E[K[0]])) // 2)
    try:
        cut = S3ObjectStore(
            cfg.model_copy(update={"endpoint": proxy.endpoint, "create_bucket": False})
        )
        store = EntryStore(cut, memory_bytes=0, metrics=StoreMetrics(CollectorRegistry()))
        result = fetch_entries(store, K[:3], Recompute(), store_computed=False)
    finally:
        proxy.close()
    _check(result, K[:3])
    assert len(result.fallbacks) == 3
    assert set(result.fallbacks.values()) <= {"unavailable", "corrupt"}


def test_hung_load_times_out_while_misses_compute(s3_server) -> None:  # noqa: ANN001
    direct = S3ObjectStore(s3_server.config())
    EntryStore(direct, memory_bytes=0).put(E[K[0]])
    proxy = CuttingProxy(s3_server.port, limit=1000, stall=True)
    try:
        cfg = direct.cfg.model_copy(
            update={"endpoint": proxy.endpoint, "create_bucket": False, "timeout_s": 5.0}
        )
        store = EntryStore(
            S3ObjectStore(cfg), memory_bytes=0, metrics=StoreMetrics(CollectorRegistry())
        )
        compute = Recompute(delay=0.2)
        t0 = time.monotonic()
        result = fetch_entries(
            store, [K[0], K[1]], compute, load_timeout_s=0.6, store_computed=False
        )
        elapsed = time.monotonic() - t0
    finally:
        proxy.close()
    _check(result, [K[0], K[1]])
    assert result.fallbacks == {K[0]: "timeout", K[1]: "missing"} or result.fallbacks == {
        K[0]: "timeout",
        K[1]: "unavailable",
    }
    assert compute.started[K[1]] < 0.5  # the miss computed while the load was still hanging
    assert compute.started[K[0]] >= 0.6 and elapsed < 2.0


def test_compute_failure_is_a_clear_error(objects, tmp_path) -> None:  # noqa: ANN001
    store = _store(objects, tmp_path)
    store.put(E[K[0]])

    def broken(key: str):  # noqa: ANN202
        raise RuntimeError("engine down")

    with pytest.raises(FetchError, match="engine down"):
        fetch_entries(store, [K[0], K[1]], broken, pin=True)
    assert store.memory.pins(K[0]) == 0
    with pytest.raises(FetchError, match="returned entry"):
        fetch_entries(store, [K[1]], lambda key: E[K[2]])


def test_pins_held_until_release(objects, tmp_path) -> None:  # noqa: ANN001
    store = _store(objects, tmp_path)
    store.put(E[K[0]])
    store.put(E[K[1]])
    store.memory.discard(K[1])
    with fetch_entries(store, [K[0], K[1], K[2]], Recompute(), pin=True) as result:
        _check(result, [K[0], K[1], K[2]])
        assert [store.memory.pins(k) for k in K[:3]] == [1, 1, 1]
    assert [store.memory.pins(k) for k in K[:3]] == [0, 0, 0]


def test_lost_entry_recomputed_from_kept_media(objects, tmp_path) -> None:  # noqa: ANN001
    """The static library keeps the media: an entry evicted from every tier is rebuilt from it."""
    from mpic.storage.static_library import StaticLibrary

    store = _store(objects, tmp_path)
    lib = StaticLibrary(objects, store)
    media = b"png-bytes-of-file-7"
    rec = lib.add_file(
        "alice", name="a.png", media_type="image/png", media=media, entry=make_entry(7, media=media)
    )
    store.delete(rec.entry_key)  # evicted / lost while the file is still live

    def recompute(key: str):  # noqa: ANN202 - the engine would encode lib.media(...) here
        assert key == rec.entry_key
        return make_entry(7, media=lib.media("alice", rec.file_id))

    result = fetch_entries(store, [rec.entry_key], recompute)
    assert result.fallbacks == {rec.entry_key: "missing"}
    assert_same(result.entries[0], make_entry(7, media=media))
    assert store.load(rec.entry_key)[1] == "memory"
