"""An engine that stores its own entries (vLLM's connector) is not written twice on upload."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from mpic.storage.entry_store import EntryStore, entry_object_key
from mpic.storage.metrics import StoreMetrics
from mpic.storage.object_store import ObjectNotFoundError
from mpic.storage.static_library import StaticLibrary
from tests.storage.synthetic import make_entry


def _lib(objects):  # noqa: ANN001, ANN202
    metrics = StoreMetrics(CollectorRegistry())
    entries = EntryStore(objects, memory_bytes=1 << 20, metrics=metrics)
    return StaticLibrary(objects, entries, default_ttl_s=100, max_ttl_s=1000), metrics


def _written(metrics: StoreMetrics) -> float:
    return metrics.bytes_written.labels("object")._value.get()


def test_stored_entry_is_not_written_again(objects) -> None:  # noqa: ANN001
    lib, metrics = _lib(objects)
    entry = make_entry(7, media=b"png-7")
    lib.entries.put(entry)  # what the engine did in its own process
    before = _written(metrics)
    rec = lib.add_file(
        "alice",
        name="a.png",
        media_type="image/png",
        media=b"png-7",
        entry=entry,
        entry_stored=True,
    )
    assert _written(metrics) == before
    assert lib.resolve("alice", [rec.file_id])[0].entry_key == entry.entry_id


def test_stored_entry_that_is_missing_fails_the_upload(objects) -> None:  # noqa: ANN001
    lib, _ = _lib(objects)
    entry = make_entry(8, media=b"png-8")
    with pytest.raises(ObjectNotFoundError):
        lib.add_file(
            "alice",
            name="b.png",
            media_type="image/png",
            media=b"png-8",
            entry=entry,
            entry_stored=True,
        )
    assert not objects.exists(entry_object_key(entry.entry_id))
    assert lib.list_files("alice") == []
