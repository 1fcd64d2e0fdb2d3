"""Object-store key layout of cache entries (torch-free, so catalog-only processes such as the
HTTP ingress can name entry blobs without importing the entry codec)."""

from __future__ import annotations

ENTRY_PREFIX = "entries/"


def entry_object_key(key: str) -> str:
    """Object-store key of an entry blob."""
    return ENTRY_PREFIX + key
