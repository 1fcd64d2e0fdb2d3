"""Storage faults survived (issue 16): a full disk tier degrades to the object store (no error, no
partial file left behind), and an S3 outage gives a typed 503 error and recovers by itself once
the server is back, without a new store object."""

from __future__ import annotations

import resource
import signal
import time
import uuid

import pytest

from mpic.storage.entry_store import EntryStore
from mpic.storage.object_store import StoreUnavailableError
from mpic.storage.s3_store import S3ObjectStore
from mpic.storage.tiers.disk import DiskTier
from tests.storage.synthetic import assert_same, make_entry


class _FileSizeLimit:
    """RLIMIT_FSIZE for this process: writes past `limit` bytes fail with EFBIG (the kernel's
    answer for a full quota), SIGXFSZ ignored so the write returns an error."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def __enter__(self) -> None:
        self.saved = resource.getrlimit(resource.RLIMIT_FSIZE)
        self.handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, self.saved[1]))

    def __exit__(self, *exc: object) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, self.saved)
        signal.signal(signal.SIGXFSZ, self.handler)


def _files(root) -> list:
    return [p for p in root.rglob("*") if p.is_file()]


def test_full_disk_tier_degrades_to_object_store(s3_server, tmp_path) -> None:
    objects = S3ObjectStore(s3_server.config(prefix="full"))  # moto keeps objects in memory
    disk_root = tmp_path / "disk"
    store = EntryStore(objects, memory_bytes=64 << 20, disk=DiskTier(disk_root, 1 << 30))
    entry = make_entry(1, layers=2, tokens=1024, heads=2, dim=64)  # ~2 MB blob
    with _FileSizeLimit(256 * 1024):
        key = store.put(entry)  # the disk write fails mid-file: no exception
        fresh = EntryStore(objects, memory_bytes=64 << 20, disk=DiskTier(disk_root, 1 << 30))
        got, tier = fresh.load(key)  # served from the object store; promotion fails quietly
    assert tier == "object"
    assert_same(got, entry)
    assert _files(disk_root) == []  # no half file, no temp file
    assert store.disk.write_errors == 1 and fresh.disk.write_errors == 1
    failed = store.metrics.fallbacks.labels("disk_write_failed")._value.get()
    assert failed == 1
    # the disk has room again: the next load promotes into the disk tier
    again = EntryStore(objects, memory_bytes=64 << 20, disk=DiskTier(disk_root, 1 << 30))
    assert again.load(key)[1] == "object" and key in again.disk
    assert again.load(key)[1] == "memory"
    objects.close()


def test_s3_outage_then_back(s3_server) -> None:
    cfg = s3_server.config(prefix=f"outage-{uuid.uuid4().hex[:6]}")
    objects = S3ObjectStore(cfg)
    entry = make_entry(2)
    key = EntryStore(objects).put(entry)
    store = EntryStore(objects, memory_bytes=1)  # nothing stays in memory: every load reads S3
    with s3_server.down():
        t0 = time.perf_counter()
        with pytest.raises(StoreUnavailableError) as err:
            store.load(key)
        assert time.perf_counter() - t0 < 30
        assert err.value.status == 503
        assert cfg.endpoint not in err.value.message  # no endpoint in what a client may see
    got, tier = store.load(key)  # the same store object recovers without a restart
    assert tier == "object"
    assert_same(got, entry)
    objects.close()
