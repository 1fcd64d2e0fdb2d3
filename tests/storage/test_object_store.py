"""Object-store contract on both backends (filesystem, S3 via minio against moto) + factory."""

from __future__ import annotations

import pytest

from mpic.storage.config import StorageConfig
from mpic.storage.factory import make_object_store, s3_config_from_url
from mpic.storage.fs_store import FileSystemObjectStore
from mpic.storage.object_store import ObjectNotFoundError, StoreUnavailableError
from mpic.storage.s3_store import S3ObjectStore


def test_put_get_range_list_delete(objects) -> None:  # noqa: ANN001
    data = bytes(range(256)) * 40
    objects.put("entries/ab", data)
    objects.put("entries/ac", b"x")
    objects.put("media/zz", b"yy")
    assert objects.get("entries/ab") == data
    assert objects.get_range("entries/ab", 300, 10) == data[300:310]
    assert objects.get_range("entries/ab", len(data) - 3, 10) == data[-3:]
    assert list(objects.list("entries/")) == ["entries/ab", "entries/ac"]
    assert list(objects.list("entries/a")) == ["entries/ab", "entries/ac"]
    assert list(objects.list("")) == ["entries/ab", "entries/ac", "media/zz"]
    assert objects.stat("entries/ab").size == len(data)
    assert objects.exists("media/zz") and not objects.exists("media/none")
    objects.put("entries/ab", b"new")  # overwrite is atomic and complete
    assert objects.get("entries/ab") == b"new"
    objects.delete("entries/ab")
    objects.delete("entries/ab")  # idempotent
    assert list(objects.list("entries/")) == ["entries/ac"]
    with pytest.raises(ObjectNotFoundError):
        objects.get("entries/ab")
    with pytest.raises(ObjectNotFoundError):
        objects.open_read("entries/ab")


def test_json_and_stream(objects) -> None:  # noqa: ANN001
    objects.put_json("cat/x.json", {"a": [1, 2], "b": "é"})
    assert objects.get_json("cat/x.json") == {"a": [1, 2], "b": "é"}
    objects.put("blob", b"0123456789")
    stream = objects.open_read("blob")
    buf = bytearray(10)
    got = 0
    while got < 10:
        got += stream.readinto(memoryview(buf)[got:])
    stream.close()
    assert stream.size == 10 and bytes(buf) == b"0123456789"


@pytest.mark.parametrize("key", ["../x", "/abs", "a//b", "a/./b", "sp ace", ""])
def test_bad_keys_rejected(objects, key: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError):
        objects.put(key, b"x")


def test_fs_list_hides_temp_files(tmp_path) -> None:  # noqa: ANN001
    store = FileSystemObjectStore(tmp_path, fsync=False)
    (tmp_path / ".tmp" / "dead.part").write_bytes(b"half")
    store.put("a", b"1")
    assert list(store.list()) == ["a"]
    assert store.clean_tmp(older_than_s=0) == 1


def test_factory_urls(tmp_path, s3_server) -> None:  # noqa: ANN001
    fs = make_object_store(f"file://{tmp_path}/st")
    assert isinstance(fs, FileSystemObjectStore) and fs.root == tmp_path / "st"
    url = (
        f"s3://bucket1/pre/fix?endpoint={s3_server.endpoint}&secure=false&region=us-east-1"
        "&access_key=testing&secret_key=testing"
    )
    cfg = s3_config_from_url(url)
    assert (cfg.bucket, cfg.prefix, cfg.secure) == ("bucket1", "pre/fix", False)
    s3 = make_object_store(StorageConfig(url=url))
    assert isinstance(s3, S3ObjectStore)
    s3.put("k", b"v")
    assert s3.client.get_object("bucket1", "pre/fix/k").read() == b"v"
    with pytest.raises(ValueError, match="valid: file, s3"):
        make_object_store("ftp://x/y")
    with pytest.raises(ValueError, match="endpoint"):
        s3_config_from_url("s3://bucket1/p")
    with pytest.raises(ValueError, match="unknown S3 URL fields"):
        s3_config_from_url("s3://bucket1/p?endpoint=h:1&colour=red")


def test_s3_down_is_unavailable_and_recovers(s3_server) -> None:  # noqa: ANN001
    store = S3ObjectStore(s3_server.config())
    store.put("k", b"v")
    with s3_server.down():
        with pytest.raises(StoreUnavailableError):
            store.get("k")
        with pytest.raises(StoreUnavailableError):
            store.put("k2", b"v")
    assert store.get("k") == b"v" and not store.exists("k2")
