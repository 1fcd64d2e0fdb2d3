"""S3 object store through the `minio` SDK: entries, catalogs and index versions shared by every
node of a cluster (Serve replicas, vLLM workers, admin CLI on any node).

One PUT is atomic on S3, so `put` needs no temp object. Connection failures and timeouts become
`StoreUnavailableError` quickly (bounded retries) so callers fall back to recomputation.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import urllib3
from minio import Minio
from minio.error import S3Error

from mpic.storage.config import S3Config
from mpic.storage.object_store import (
    ObjectInfo,
    ObjectNotFoundError,
    ObjectStore,
    StoreFullError,
    StoreUnavailableError,
    check_key,
)

_MISSING = {"NoSuchKey", "NoSuchObject", "NotFound", "ResourceNotFound"}
_FULL = {
    "XMinioStorageFull",  # MinIO: drives past their free-space threshold (HTTP 507)
    "XMinioAdminBucketQuotaExceeded",  # MinIO bucket quota
    "QuotaExceeded",  # Ceph RGW, and S3-compatible stores with quotas
    "InsufficientStorage",
    "StorageFull",
}
"""S3 error codes that mean the store has no room: `StoreFullError` (HTTP 507)."""


class _ResponseStream:
    """ReadStream over a streaming GET response."""

    def __init__(self, resp: urllib3.BaseHTTPResponse, size: int) -> None:
        self._resp = resp
        self.size = size

    def readinto(self, buf: memoryview) -> int:
        try:
            return self._resp.readinto(buf)
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise StoreUnavailableError(f"S3 read failed: {e}") from e

    def close(self) -> None:
        self._resp.close()
        self._resp.release_conn()


class S3ObjectStore(ObjectStore):
    """Objects in `bucket` under `prefix`."""

    name = "s3"

    def __init__(self, cfg: S3Config) -> None:
        self.cfg = cfg
        timeout = urllib3.Timeout(connect=cfg.timeout_s, read=cfg.timeout_s)
        # retry server errors (S3 "slow down", transient 500s); a refused connection fails at
        # once so callers fall back to recomputation quickly
        retry = urllib3.Retry(
            total=cfg.retries,
            connect=0,
            read=0,
            status=cfg.retries,
            backoff_factor=0.05,
            status_forcelist=[500, 502, 503, 504],
            raise_on_status=False,
        )
        http = urllib3.PoolManager(timeout=timeout, retries=retry, maxsize=16)
        self.client = Minio(
            cfg.endpoint,
            access_key=cfg.access_key,
            secret_key=cfg.secret_key.get_secret_value(),
            secure=cfg.secure,
            region=cfg.region,
            http_client=http,
        )
        self._prefix = cfg.prefix.strip("/") + "/" if cfg.prefix.strip("/") else ""
        if cfg.create_bucket:
            self._call(self._ensure_bucket, "")

    def _ensure_bucket(self) -> None:
        if not self.client.bucket_exists(self.cfg.bucket):
            try:
                self.client.make_bucket(self.cfg.bucket)
            except S3Error as e:
                if e.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

    def _name(self, key: str) -> str:
        return self._prefix + check_key(key)

    def _call(self, fn, key: str):  # noqa: ANN001, ANN202 - thin error-mapping wrapper
        try:
            return fn()
        except S3Error as e:
            if e.code in _MISSING:
                raise ObjectNotFoundError(key) from e
            if e.code in _FULL:
                raise StoreFullError(f"S3 full on {key!r}: {e.code}") from e
            raise StoreUnavailableError(f"S3 error on {key!r}: {e.code}") from e
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise StoreUnavailableError(f"S3 unreachable on {key!r}: {e}") from e

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        self._call(
            lambda: self.client.put_object(
                self.cfg.bucket, self._name(key), io.BytesIO(view), len(view), part_size=64 << 20
            ),
            key,
        )

    def _read(self, key: str, offset: int = 0, length: int = 0) -> bytes:
        def go() -> bytes:
            resp = self.client.get_object(self.cfg.bucket, self._name(key), offset, length)
            try:
                return resp.read()
            finally:
                resp.close()
                resp.release_conn()

        return self._call(go, key)

    def get(self, key: str) -> bytes:
        return self._read(key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        return self._read(key, start, length)

    def open_read(self, key: str) -> _ResponseStream:
        resp = self._call(lambda: self.client.get_object(self.cfg.bucket, self._name(key)), key)
        return _ResponseStream(resp, int(resp.headers["Content-Length"]))

    def stat(self, key: str) -> ObjectInfo:
        st = self._call(lambda: self.client.stat_object(self.cfg.bucket, self._name(key)), key)
        return ObjectInfo(key=key, size=int(st.size or 0), mtime=st.last_modified.timestamp())

    def delete(self, key: str) -> None:
        self._call(lambda: self.client.remove_object(self.cfg.bucket, self._name(key)), key)

    def list(self, prefix: str = "") -> Iterator[str]:
        objs = self._call(
            lambda: list(
                self.client.list_objects(
                    self.cfg.bucket, prefix=self._prefix + prefix, recursive=True
                )
            ),
            prefix,
        )
        return iter(sorted(o.object_name[len(self._prefix) :] for o in objs))

    def close(self) -> None:
        self.client._http.clear()
