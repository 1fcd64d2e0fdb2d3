"""Static library: per-user isolation, TTL and tombstones, reference-counted sweeping, dedup that
reveals nothing, expiry of a pinned entry, and uploads that fail half-way."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from mpic.errors import ExpiredError, InvalidRequestError, NotFoundError
from mpic.storage.entry_store import EntryStore, entry_object_key
from mpic.storage.metrics import StoreMetrics
from mpic.storage.object_store import ObjectNotFoundError
from mpic.storage.static_library import StaticLibrary, media_key
from tests.storage.synthetic import assert_same, make_entry


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def lib(objects):  # noqa: ANN001, ANN201
    entries = EntryStore(objects, memory_bytes=1 << 20, metrics=StoreMetrics(CollectorRegistry()))
    return StaticLibrary(
        objects,
        entries,
        default_ttl_s=100,
        max_ttl_s=1000,
        grace_s=0,
        tombstone_ttl_s=50,
        clock=Clock(),
    )


def _upload(lib: StaticLibrary, user: str, seed: int, media: bytes | None = None, **kw):  # noqa: ANN003, ANN202
    media = media if media is not None else f"png-{seed}".encode()
    entry = make_entry(seed, media=media)
    return lib.add_file(
        user, name=f"f{seed}.png", media_type="image/png", media=media, entry=entry, **kw
    ), entry


def _probe(lib: StaticLibrary, user: str, file_id: str) -> list[str]:
    """Every answer a user can get about one id (get, resolve, media, delete)."""
    out = []
    for call in (lib.get, lambda u, f: lib.resolve(u, [f]), lib.media, lib.delete_file):
        try:
            call(user, file_id)
            out.append("ok")
        except (NotFoundError, ExpiredError) as e:
            out.append(f"{type(e).__name__}:{e.status}:{e.code}:{e.message}:{e.param}")
    return out


def test_isolation_same_answer_as_never_existed(lib) -> None:  # noqa: ANN001
    rec, _ = _upload(lib, "alice", 1)
    assert rec.file_id.startswith("file-") and len(rec.file_id) == 29
    assert lib.get("alice", rec.file_id) == rec
    never = "file-" + "A" * 24
    bob_on_alice = _probe(lib, "bob", rec.file_id)
    bob_on_never = _probe(lib, "bob", never)
    assert all(a.startswith("NotFoundError:404") for a in bob_on_alice)
    assert [a.replace(rec.file_id, "ID") for a in bob_on_alice] == [
        a.replace(never, "ID") for a in bob_on_never
    ]
    assert lib.list_files("bob") == []
    assert [r.file_id for r in lib.list_files("alice")] == [rec.file_id]
    assert lib.get("alice", rec.file_id) == rec  # bob's delete attempt did nothing
    assert _probe(lib, "bob", "garbage/../x") == [
        a.replace(never, "garbage/../x") for a in bob_on_never
    ]


def test_dedup_shares_blobs_without_revealing(lib, objects) -> None:  # noqa: ANN001
    a, entry = _upload(lib, "alice", 1, media=b"same-bytes")
    before = set(objects.list(""))
    b, _ = _upload(lib, "bob", 1, media=b"same-bytes")
    assert (a.content_hash, a.entry_key) == (b.content_hash, b.entry_key)
    assert a.file_id != b.file_id
    new = set(objects.list("")) - before
    # bob's upload added only his own record and reference markers: no second copy of blobs
    assert all(k.startswith(("static/u/", "refs/")) for k in new) and len(new) == 3
    assert len(list(objects.list("media/"))) == 1 and len(list(objects.list("entries/"))) == 1
    # bob's record reveals nothing of alice (no owner, no shared flag)
    assert set(b.model_dump()) == set(a.model_dump())
    lib.delete_file("alice", a.file_id)
    lib.sweep()
    assert lib.media("bob", b.file_id) == b"same-bytes"
    assert_same(lib.entries.get(b.entry_key), entry)
    lib.delete_file("bob", b.file_id)
    report = lib.sweep()
    assert sorted(report.blobs_deleted) == sorted(
        [media_key(a.content_hash), entry_object_key(a.entry_key)]
    )
    assert list(objects.list("media/")) == [] and list(objects.list("entries/")) == []
    assert list(objects.list("refs/")) == []


def test_ttl_expiry_tombstone_and_sweep(lib, objects) -> None:  # noqa: ANN001
    short, _ = _upload(lib, "alice", 1, ttl_s=10)
    long, _ = _upload(lib, "alice", 2)
    with pytest.raises(InvalidRequestError):
        _upload(lib, "alice", 3, ttl_s=5000)
    with pytest.raises(InvalidRequestError):
        _upload(lib, "alice", 3, ttl_s=0)
    lib.clock.t += 10
    with pytest.raises(ExpiredError):  # expired before any sweep
        lib.get("alice", short.file_id)
    assert [r.file_id for r in lib.list_files("alice")] == [long.file_id]
    report = lib.sweep()
    assert report.expired == [short.file_id]
    assert media_key(short.content_hash) in report.blobs_deleted
    with pytest.raises(ExpiredError):  # tombstone answers 410
        lib.get("alice", short.file_id)
    assert _probe(lib, "bob", short.file_id)[0].startswith("NotFoundError")
    lib.clock.t += 50
    assert lib.sweep().tombstones_removed == 1
    with pytest.raises(NotFoundError):
        lib.get("alice", short.file_id)
    assert lib.get("alice", long.file_id) == long and lib.media("alice", long.file_id)


def test_expiry_while_entry_pinned(lib) -> None:  # noqa: ANN001
    rec, entry = _upload(lib, "alice", 1, ttl_s=10)
    with lib.entries.pinned([rec.entry_key]) as (pinned,):
        lib.clock.t += 11
        report = lib.sweep()
        assert entry_object_key(rec.entry_key) in report.blobs_deleted
        assert_same(pinned, entry)  # the running request keeps intact KV
        assert lib.entries.memory.pins(rec.entry_key) == 1
        assert lib.entries.locate(rec.entry_key) is None  # invisible to new lookups
    assert lib.entries.memory.used == 0
    with pytest.raises(ObjectNotFoundError):
        lib.entries.get(rec.entry_key)


def test_failed_upload_leaves_nothing_visible(lib, objects) -> None:  # noqa: ANN001
    class Boom(Exception):
        pass

    real_put_json = objects.put_json

    def failing_put_json(key, obj):  # noqa: ANN001, ANN202
        raise Boom("crash before the catalog record")

    objects.put_json = failing_put_json
    with pytest.raises(Boom):
        _upload(lib, "alice", 7)
    objects.put_json = real_put_json
    assert lib.list_files("alice") == []
    assert list(objects.list("static/")) == []
    # the orphan blobs are collected once the grace period has passed
    report = lib.sweep()
    assert len(report.blobs_deleted) == 2
    assert list(objects.list("media/")) == [] and list(objects.list("refs/")) == []
