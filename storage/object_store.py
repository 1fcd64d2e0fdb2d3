"""The narrow object-store interface every durable byte of MPIC goes through (any process that
reads or writes stored state: Serve replicas, vLLM workers, the admin CLI).

Two backends implement it, one per file (LMCache-v1 style): `fs_store.FileSystemObjectStore`
(the embedded default) and `s3_store.S3ObjectStore` (S3 / MinIO through the `minio` SDK). Keys
are '/'-separated relative paths ("entries/ab12...", "dynamic/refs/CURRENT"). Every `put` is
atomic: a reader sees the old object or the new one, never a part (temp file + os.replace on
disk; a single PUT on S3).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from mpic.errors import MPICError

_KEY_RE = re.compile(r"^[A-Za-z0-9_.=-]+(/[A-Za-z0-9_.=-]+)*$")


class ObjectNotFoundError(LookupError):
    """The key does not exist in the store (internal: callers map it to their own answer)."""


class StoreUnavailableError(MPICError):
    """The backing store cannot be reached (server down, timeout); callers recompute (HTTP 503)."""

    status = 503
    code = "store_unavailable"


class StoreFullError(MPICError):
    """The object store has no room left (a full disk, ENOSPC / EDQUOT; S3 quota or storage-full
    replies): HTTP 507 with Retry-After. The failed write leaves nothing half-written (a temp
    file is removed; one S3 PUT is atomic); blobs an upload wrote before it carry no record and
    no reference, so the sweeper deletes them after the grace period."""

    status = 507
    type = "server_error"
    code = "insufficient_storage"
    retry_after = 60

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = "the object store is full; nothing of this upload was kept, retry later"
        self.detail = message


FULL_ERRNOS = frozenset({28, 122})
"""ENOSPC (no space left on device), EDQUOT (disk quota exceeded)."""


def check_key(key: str) -> str:
    """Return `key` if it is a safe relative key (no '..', no leading '/'), else ValueError."""
    if not _KEY_RE.match(key) or any(part in (".", "..") for part in key.split("/")):
        raise ValueError(f"invalid object key {key!r}: use [A-Za-z0-9_.=-] parts joined by '/'")
    return key


@dataclass(frozen=True)
class ObjectInfo:
    """What `stat` tells about a stored object."""

    key: str
    size: int
    mtime: float
    """Last modification, seconds since the epoch."""


class ReadStream(Protocol):
    """A sequential reader over one object (a file, or an HTTP response body)."""

    size: int

    def readinto(self, buf: memoryview) -> int:
        """Fill `buf` from the current offset; return the byte count (0 at the end)."""
        ...

    def close(self) -> None:
        """Release the file or connection."""
        ...


class ObjectStore(ABC):
    """put / get / ranged get / stream / exists / stat / delete / list over string keys."""

    name: str = "object"

    @abstractmethod
    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Store `data` under `key`, atomically replacing any previous object."""

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The whole object; ObjectNotFoundError if absent."""

    @abstractmethod
    def get_range(self, key: str, start: int, length: int) -> bytes:
        """`length` bytes from offset `start` (fewer at the end of the object)."""

    @abstractmethod
    def open_read(self, key: str) -> ReadStream:
        """A sequential stream over the object (caller closes it); ObjectNotFoundError if absent."""

    @abstractmethod
    def stat(self, key: str) -> ObjectInfo:
        """Size and modification time; ObjectNotFoundError if absent."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; deleting an absent key is not an error."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Keys starting with `prefix` (a plain string prefix), in lexicographic order."""

    def exists(self, key: str) -> bool:
        """True if `key` is stored."""
        try:
            self.stat(key)
        except ObjectNotFoundError:
            return False
        return True

    def put_json(self, key: str, obj: Any) -> None:
        """Store `obj` as UTF-8 JSON (atomic like `put`)."""
        self.put(key, json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())

    def get_json(self, key: str) -> Any:
        """Load a JSON object written by `put_json`; ObjectNotFoundError if absent."""
        return json.loads(self.get(key))

    def close(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Release connections (no-op by default)."""
