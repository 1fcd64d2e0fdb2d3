"""Storage test fixtures: every object-store test runs on the filesystem backend and on a real
S3 server (moto on loopback, tests/fixtures/s3.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mpic.storage.fs_store import FileSystemObjectStore
from mpic.storage.object_store import ObjectStore
from mpic.storage.s3_store import S3ObjectStore


@pytest.fixture(params=["fs", "s3"])
def objects(request: pytest.FixtureRequest, tmp_path) -> Iterator[ObjectStore]:  # noqa: ANN001
    """A fresh, empty object store of each backend."""
    if request.param == "fs":
        store: ObjectStore = FileSystemObjectStore(tmp_path / "store", fsync=False)
    else:
        server = request.getfixturevalue("s3_server")
        store = S3ObjectStore(server.config(prefix="mpic"))
    yield store
    store.close()
