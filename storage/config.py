"""Storage configuration (every process that opens the store): where durable objects live and
how large the memory and disk tiers may grow. Loaded from YAML/env at the edges, passed down."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr


class S3Config(BaseModel):
    """An S3-compatible server (MinIO, Ceph, AWS S3, moto in tests) reached with the minio SDK."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str = Field(description="host:port of the S3 server, without scheme.")
    bucket: str = Field(min_length=3, description="Bucket holding every MPIC object.")
    prefix: str = Field("", description="Key prefix inside the bucket ('' or 'a/b').")
    access_key: str = Field("", description="Access key id.")
    secret_key: SecretStr = Field(SecretStr(""), description="Secret access key.")
    secure: bool = Field(True, description="Use HTTPS.")
    region: str | None = Field(None, description="Region name, if the server needs one.")
    timeout_s: float = Field(10.0, gt=0, description="Connect and read timeout per request.")
    retries: int = Field(3, ge=0, description="Retries of a request answered 5xx.")
    create_bucket: bool = Field(True, description="Create the bucket if it does not exist.")


class StorageConfig(BaseModel):
    """The object store (durable, shared) plus the local tiers in front of it."""

    model_config = ConfigDict(extra="forbid")

    url: str | None = Field(
        None,
        description="file:///abs/path, or s3://bucket/prefix?endpoint=host:port&secure=false "
        "(keys from `s3` or MPIC_S3_ACCESS_KEY / MPIC_S3_SECRET_KEY). None: `s3` if set, "
        "else the filesystem store under MPICHome().store_dir.",
    )
    s3: S3Config | None = Field(None, description="S3 settings (used when `url` is None).")
    fsync: bool = Field(True, description="fsync filesystem writes before the atomic rename.")
    memory_bytes: int = Field(2 << 30, ge=0, description="Memory tier capacity (LRU by bytes).")
    disk_cache_dir: Path | None = Field(
        None, description="Local disk tier folder; None disables the disk tier."
    )
    disk_bytes: int = Field(20 << 30, ge=0, description="Disk tier capacity (LRU by bytes).")
    load_workers: int = Field(4, ge=1, description="Threads loading entries in parallel.")
    load_timeout_s: float = Field(30.0, gt=0, description="A load slower than this is recomputed.")
    file_ttl_s: float = Field(86400.0, gt=0, description="Default lifetime of an uploaded file.")
    max_file_ttl_s: float = Field(30 * 86400.0, gt=0, description="Largest per-upload TTL.")
    sweep_grace_s: float = Field(
        600.0, ge=0, description="Unreferenced blobs younger than this survive a sweep."
    )
    tombstone_ttl_s: float = Field(
        7 * 86400.0, ge=0, description="How long an expired file answers 'expired' (410)."
    )
