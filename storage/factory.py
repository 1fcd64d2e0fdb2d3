"""Build the object store named by a `StorageConfig` (or a URL) and the entry store's tiers: the
one place that knows the backends and the tier order (every process that opens the store)."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

from pydantic import SecretStr

from mpic.config import MPICHome
from mpic.storage.config import S3Config, StorageConfig
from mpic.storage.fs_store import FileSystemObjectStore
from mpic.storage.object_store import ObjectStore
from mpic.storage.tiers.disk import DiskTier
from mpic.storage.tiers.memory import MemoryTier
from mpic.storage.tiers.object import ObjectTier
from mpic.storage.tiers.tier import StorageTier

_TRUE = {"1", "true", "yes", "on"}

TIERS: tuple[type[StorageTier], ...] = (MemoryTier, DiskTier, ObjectTier)
"""The entry store's tiers in lookup order, fastest first; the last one is durable."""


def s3_config_from_url(url: str) -> S3Config:
    """`s3://bucket/prefix?endpoint=host:port&secure=false&region=r` -> S3Config; keys come from
    `access_key`/`secret_key` query fields or MPIC_S3_ACCESS_KEY / MPIC_S3_SECRET_KEY."""
    u = urlparse(url)
    q = {k: v[-1] for k, v in parse_qs(u.query).items()}
    if "endpoint" not in q:
        raise ValueError(f"S3 URL {url!r} needs ?endpoint=host:port")
    unknown = set(q) - {"endpoint", "secure", "region", "access_key", "secret_key"}
    if unknown:
        raise ValueError(
            f"unknown S3 URL fields {sorted(unknown)}; valid: endpoint, secure, "
            "region, access_key, secret_key"
        )
    return S3Config(
        endpoint=q["endpoint"],
        bucket=u.netloc,
        prefix=unquote(u.path).strip("/"),
        access_key=q.get("access_key", os.environ.get("MPIC_S3_ACCESS_KEY", "")),
        secret_key=SecretStr(q.get("secret_key", os.environ.get("MPIC_S3_SECRET_KEY", ""))),
        secure=q.get("secure", "true").lower() in _TRUE,
        region=q.get("region"),
    )


def make_object_store(cfg: StorageConfig | str | None = None) -> ObjectStore:
    """The durable store: `file://` (filesystem) or `s3://` (minio SDK); ValueError otherwise."""
    if not isinstance(cfg, StorageConfig):
        cfg = StorageConfig(url=cfg)
    if cfg.url is None:
        if cfg.s3 is not None:
            from mpic.storage.s3_store import S3ObjectStore

            return S3ObjectStore(cfg.s3)
        return FileSystemObjectStore(MPICHome().store_dir, fsync=cfg.fsync)
    scheme = urlparse(cfg.url).scheme
    if scheme == "file":
        return FileSystemObjectStore(Path(unquote(urlparse(cfg.url).path)), fsync=cfg.fsync)
    if scheme == "s3":
        from mpic.storage.s3_store import S3ObjectStore

        return S3ObjectStore(s3_config_from_url(cfg.url))
    raise ValueError(f"unknown storage URL scheme {scheme!r} in {cfg.url!r}; valid: file, s3")


def make_tiers(cfg: StorageConfig, objects: ObjectStore | None = None) -> list[StorageTier]:
    """The tiers `cfg` enables, in `TIERS` order (the object store from `cfg` unless given)."""
    if objects is None:
        objects = make_object_store(cfg)
    tiers = [t.from_config(cfg, objects) for t in TIERS]
    return [t for t in tiers if t is not None]
