"""Filesystem object store: the embedded default backend, also the body of the disk tier
(runs in Serve replicas, vLLM workers and the CLI on one machine).

Atomic put = write a temp file under `<root>/.tmp/`, optionally fsync, then `os.replace` onto the
final path (same filesystem, so the rename is atomic). A writer killed at any point leaves at most
an orphan temp file, which `list` never shows and `clean_tmp` removes.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

from mpic.storage.object_store import (
    FULL_ERRNOS,
    ObjectInfo,
    ObjectNotFoundError,
    ObjectStore,
    StoreFullError,
    check_key,
)

_TMP = ".tmp"


class _FileStream:
    """ReadStream over an open file."""

    def __init__(self, path: Path) -> None:
        self._f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        self.size = os.fstat(self._f.fileno()).st_size
        os.posix_fadvise(self._f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)  # whole-file reads

    def readinto(self, buf: memoryview) -> int:
        return self._f.readinto(buf) or 0

    def close(self) -> None:
        self._f.close()


class FileSystemObjectStore(ObjectStore):
    """Objects as files under `root`; keys map to relative paths."""

    name = "fs"

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.root = Path(root)
        self.fsync = fsync
        (self.root / _TMP).mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        """The file that holds `key`."""
        return self.root / check_key(key)

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        final = self.path(key)
        tmp = self.root / _TMP / f"{secrets.token_hex(8)}.part"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, final)
        except OSError as e:
            if e.errno in FULL_ERRNOS:  # nothing half-written: the temp file goes below
                raise StoreFullError(f"no space for {key!r}: {e}") from e
            raise
        finally:
            tmp.unlink(missing_ok=True)

    def get(self, key: str) -> bytes:
        try:
            return self.path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
            raise ObjectNotFoundError(key) from e

    def get_range(self, key: str, start: int, length: int) -> bytes:
        with self._open(key) as f:
            f.seek(start)
            return f.read(length)

    def open_read(self, key: str) -> _FileStream:
        try:
            return _FileStream(self.path(key))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
            raise ObjectNotFoundError(key) from e

    def map_read(self, key: str) -> mmap.mmap:
        """A private copy-on-write memory map of the whole object (zero-copy reads; writes to it
        never reach the file). Safe with this store's writers: files are replaced by rename,
        never truncated in place. Python's mmap keeps a duplicate descriptor open while the map
        lives. Empty objects raise ValueError."""
        with self._open(key) as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        mm.madvise(mmap.MADV_SEQUENTIAL)  # read front to back: aggressive readahead
        return mm

    def _open(self, key: str):  # noqa: ANN202 - a plain binary file
        try:
            return open(self.path(key), "rb")  # noqa: SIM115 - caller uses `with`
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
            raise ObjectNotFoundError(key) from e

    def stat(self, key: str) -> ObjectInfo:
        try:
            st = self.path(key).stat()
        except (FileNotFoundError, NotADirectoryError) as e:
            raise ObjectNotFoundError(key) from e
        if not os.path.isfile(self.path(key)):
            raise ObjectNotFoundError(key)
        return ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime)

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def list(self, prefix: str = "") -> Iterator[str]:
        base = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        if not base.is_dir():
            return iter(())
        keys = []
        for dirpath, dirnames, filenames in os.walk(base):
            rel_dir = Path(dirpath).relative_to(self.root).as_posix()
            if rel_dir == _TMP or rel_dir.startswith(_TMP + "/"):
                dirnames.clear()
                continue
            for fn in filenames:
                key = fn if rel_dir == "." else f"{rel_dir}/{fn}"
                if key.startswith(prefix):
                    keys.append(key)
        return iter(sorted(keys))

    def clean_tmp(self, older_than_s: float = 3600.0) -> int:
        """Remove temp files left by killed writers; return how many were removed."""
        removed, now = 0, time.time()
        for p in (self.root / _TMP).iterdir():
            if now - p.stat().st_mtime >= older_than_s:
                p.unlink(missing_ok=True)
                removed += 1
        return removed
