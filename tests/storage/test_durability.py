"""Durability: concurrent writers of the same content, readers during writes, and a writer
process killed with SIGKILL mid-upload: nothing half-written is ever visible (both backends)."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from mpic.errors import CorruptEntryError
from mpic.storage.config import S3Config, StorageConfig
from mpic.storage.entry_codec import decode
from mpic.storage.entry_store import EntryStore
from mpic.storage.factory import make_object_store
from mpic.storage.fs_store import FileSystemObjectStore
from mpic.storage.metrics import StoreMetrics
from mpic.storage.object_store import ObjectNotFoundError, ObjectStore
from mpic.storage.static_library import StaticLibrary
from tests.storage.synthetic import assert_same, make_entry

BIG = {"tokens": 1024, "layers": 4, "heads": 4, "dim": 64, "hidden": 128}  # ~8.5 MB per entry


def _cfg_of(objects: ObjectStore) -> StorageConfig:
    if isinstance(objects, FileSystemObjectStore):
        return StorageConfig(url=f"file://{objects.root}", fsync=False)
    return StorageConfig(s3=objects.cfg)


def test_concurrent_writers_and_readers(objects) -> None:  # noqa: ANN001
    entry = make_entry(1, **BIG)
    store = EntryStore(objects, memory_bytes=0, metrics=StoreMetrics(CollectorRegistry()))
    errors, seen = [], []

    def write() -> None:
        for _ in range(3):
            try:
                store.put(entry)
            except Exception as e:  # noqa: BLE001 - collected and asserted below
                errors.append(e)

    def read() -> None:
        other = EntryStore(objects, memory_bytes=0)
        for _ in range(6):
            try:
                seen.append(other.get(entry.entry_id))
            except ObjectNotFoundError:
                pass
            except CorruptEntryError as e:  # a half-written object would land here
                errors.append(e)

    threads = [threading.Thread(target=f) for f in (write, write, write, read, read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for got in seen:
        assert_same(got, entry)
    assert_same(EntryStore(objects, memory_bytes=0).get(entry.entry_id), entry)


def test_same_content_two_users_concurrently(objects) -> None:  # noqa: ANN001
    lib = StaticLibrary(objects, EntryStore(objects, memory_bytes=0), grace_s=0)
    entry = make_entry(2, media=b"same", **BIG)
    recs, errors = {}, []

    def upload(user: str) -> None:
        try:
            recs[user] = lib.add_file(
                user, name="x.png", media_type="image/png", media=b"same", entry=entry
            )
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=upload, args=(u,)) for u in ("a", "b", "c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(recs) == 3
    assert len(list(objects.list("entries/"))) == 1
    for user, rec in recs.items():
        assert lib.get(user, rec.file_id) == rec
        assert_same(lib.entries.get(rec.entry_key), entry)


def _writer(cfg_json: str, started: mp.Event) -> None:
    cfg = StorageConfig.model_validate_json(cfg_json)
    objects = make_object_store(cfg)
    lib = StaticLibrary(objects, EntryStore(objects, memory_bytes=0))
    started.set()
    for i in range(10_000):
        media = f"media-{i}".encode()
        lib.add_file(
            "writer",
            name=f"{i}.png",
            media_type="image/png",
            media=media,
            entry=make_entry(i, media=media, **BIG),
        )


@pytest.mark.parametrize("kill_after", [0.15, 0.6])
def test_writer_killed_mid_upload_leaves_nothing_half_visible(objects, kill_after) -> None:  # noqa: ANN001
    cfg = _cfg_of(objects)
    if isinstance(cfg.s3, S3Config):
        cfg = cfg.model_copy(update={"s3": cfg.s3.model_copy(update={"create_bucket": False})})
    ctx = mp.get_context("spawn")
    started = ctx.Event()
    proc = ctx.Process(target=_writer, args=(cfg.model_dump_json(), started), daemon=True)
    proc.start()
    assert started.wait(60), "writer did not start"
    deadline = time.monotonic() + 60
    while not list(objects.list("static/")) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(kill_after * random.uniform(0.5, 1.5))
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    lib = StaticLibrary(objects, EntryStore(objects, memory_bytes=0))
    files = lib.list_files("writer")
    assert files, "the writer never finished an upload"
    for rec in files:  # every visible file is complete and exact
        i = int(rec.name.split(".")[0])
        media = f"media-{i}".encode()
        assert lib.media("writer", rec.file_id) == media
        assert_same(lib.entries.get(rec.entry_key), make_entry(i, media=media, **BIG))
    for key in objects.list("entries/"):  # no half-written blob under a visible key
        decode(objects.get(key))
    if isinstance(objects, FileSystemObjectStore):
        assert all(not k.startswith(".tmp") for k in objects.list(""))
