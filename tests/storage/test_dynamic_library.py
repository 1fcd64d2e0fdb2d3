"""Dynamic library: immutable versions, atomic CURRENT, carry-over, abort, rollback, release."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from mpic.errors import NotFoundError
from mpic.storage.dynamic_library import DynamicLibrary
from mpic.storage.entry_store import EntryStore
from mpic.storage.metrics import StoreMetrics
from mpic.storage.static_library import StaticLibrary
from tests.storage.synthetic import assert_same, make_entry


@pytest.fixture
def lib(objects):  # noqa: ANN001, ANN201
    entries = EntryStore(objects, memory_bytes=1 << 20, metrics=StoreMetrics(CollectorRegistry()))
    return DynamicLibrary(objects, "refs", entries=entries)


def test_versions_current_rollback(lib, objects) -> None:  # noqa: ANN001
    assert lib.current() is None and lib.versions() == []
    e1, e2 = make_entry(1, media=b"img1"), make_entry(2, media=b"img2")
    with lib.begin_version(base=None) as v:
        item = v.put_item("a", media=b"img1", entry=e1, caption="first")
        v.put_blob("faiss.index", b"index-v1")
        v.extra["dim"] = 64
        m1 = v.commit()
    assert item.entry_key == e1.entry_id and item.token_count == 16
    assert lib.current() == m1 and lib.get_blob(m1, "faiss.index") == b"index-v1"
    v2 = lib.begin_version()  # carries "a" over from CURRENT
    v2.put_item("b", media=b"img2", entry=e2, caption="second")
    v2.put_blob("faiss.index", b"index-v2")
    assert lib.current_version() == m1.version  # nothing visible before commit
    m2 = v2.commit()
    assert [i.item_id for i in m2.items] == ["a", "b"] and m2.parent == m1.version
    assert m2.extra == {"dim": 64}
    assert lib.versions() == [m1.version, m2.version]
    assert lib.get_blob(lib.current(), "faiss.index") == b"index-v2"
    assert lib.manifest(m1.version) == m1  # immutable
    lib.rollback(m1.version)
    assert lib.current() == m1 and lib.get_blob(lib.current(), "faiss.index") == b"index-v1"
    assert_same(lib.entries.get(m2.item("b").entry_key), e2)
    assert objects.get(m2.item("b").media_key) == b"img2"
    with pytest.raises(NotFoundError):
        lib.rollback("v-never")
    with pytest.raises(NotFoundError):
        m1.item("b")
    with pytest.raises(NotFoundError):
        lib.get_blob(m1, "nope")


def test_abort_leaves_nothing(lib, objects) -> None:  # noqa: ANN001
    with lib.begin_version(base=None) as v:
        v.put_item("a", media=b"img1")
        m1 = v.commit()
    with pytest.raises(RuntimeError):
        with lib.begin_version() as v:
            v.put_item("x", media=b"imgx", entry=make_entry(9, media=b"imgx"))
            v.put_blob("faiss.index", b"half")
            raise RuntimeError("refresh crashed")
    assert lib.versions() == [m1.version] and lib.current() == m1
    assert list(objects.list(f"dynamic/refs/versions/{v.version}/")) == []
    assert not any(k.endswith(v.version) for k in objects.list("refs/"))


def test_release_version_and_shared_gc(lib, objects) -> None:  # noqa: ANN001
    """A blob used by an old library version and a user's file survives until both let go."""
    static = StaticLibrary(objects, lib.entries, grace_s=0)
    e = make_entry(3, media=b"shared")
    with lib.begin_version(base=None) as v:
        v.put_item("a", media=b"shared", entry=e)
        old = v.commit()
    rec = static.add_file("u", name="s.png", media_type="image/png", media=b"shared", entry=e)
    with lib.begin_version(base=None) as v:
        new = v.commit()
    with pytest.raises(ValueError, match="CURRENT"):
        lib.release_version(new.version)
    lib.release_version(old.version)
    assert lib.versions() == [new.version]
    assert static.sweep().blobs_deleted == []  # the user's file still holds the blobs
    static.delete_file("u", rec.file_id)
    assert len(static.sweep().blobs_deleted) == 2


def test_bad_names(objects) -> None:  # noqa: ANN001
    with pytest.raises(ValueError):
        DynamicLibrary(objects, "../x")
    lib = DynamicLibrary(objects, "ok")
    with pytest.raises(ValueError):
        lib.begin_version(base=None).put_blob("../../CURRENT", b"x")
    with pytest.raises(ValueError, match="EntryStore"):
        lib.begin_version(base=None).put_item("a", entry=make_entry(1))
