"""The uploaded-file catalog as the HTTP layer sees it (Ingress, Resolver and LLM-worker replicas).

A thin view over `mpic.storage.static_library.StaticLibrary` (per-user namespaces, TTL,
NotFoundError for unknown or foreign ids, ExpiredError after the TTL) that speaks OpenAI file
objects. Every replica opens its own view over the shared object store, so file records written
by the worker on one node are visible to the ingress and linker on any other.
"""

from __future__ import annotations

from mpic.deployments.schemas import FileObject
from mpic.storage.config import StorageConfig
from mpic.storage.entry_store import EntryStore
from mpic.storage.static_library import FileRecord, StaticLibrary


def open_library(cfg: StorageConfig, entries: EntryStore | None = None) -> StaticLibrary:
    """A StaticLibrary over the configured store; catalog-only replicas pass no EntryStore
    (they never write entries, so no memory tier is kept for them)."""
    if entries is None:
        entries = EntryStore.from_config(
            cfg.model_copy(update={"memory_bytes": 0, "disk_cache_dir": None})
        )
    return StaticLibrary(
        entries.objects,
        entries,
        default_ttl_s=cfg.file_ttl_s,
        max_ttl_s=cfg.max_file_ttl_s,
        grace_s=cfg.sweep_grace_s,
        tombstone_ttl_s=cfg.tombstone_ttl_s,
    )


def file_object(rec: FileRecord) -> FileObject:
    """OpenAI file object of a catalog record."""
    return FileObject(
        id=rec.file_id,
        bytes=rec.bytes,
        created_at=int(rec.created_at),
        expires_at=int(rec.expires_at),
        filename=rec.name,
        purpose=rec.purpose,
        tokens=rec.token_count,
        status="processed" if rec.status == "active" else "expired",
    )


class FileCatalog:
    """get / list / delete / resolve in the caller's namespace, as OpenAI file objects."""

    def __init__(self, cfg: StorageConfig) -> None:
        self.library = open_library(cfg)

    def get(self, user: str, file_id: str) -> FileObject:
        """404 unknown or foreign, 410 expired."""
        return file_object(self.library.get(user, file_id))

    def list(self, user: str) -> list[FileObject]:
        """The caller's live files, oldest first."""
        return [file_object(r) for r in self.library.list_files(user)]

    def delete(self, user: str, file_id: str) -> None:
        """404 unknown or foreign."""
        self.library.delete_file(user, file_id)

    def resolve(self, user: str, file_id: str) -> tuple[str, str]:
        """(entry id, media sha256) a chat request links for `file_id` (404 / 410 as `get`)."""
        rec = self.library.get(user, file_id)
        return rec.entry_key, rec.content_hash
