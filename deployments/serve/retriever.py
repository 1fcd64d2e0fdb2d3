"""The Retriever deployment (Serve replica): MRAG search and the admin operations on the dynamic
library (collections, versions, refresh, rollback), wrapping one
`mpic.retriever.service.RetrievalService` (CLIP + FAISS over immutable collection versions; every
search answers from one version).

A refresh needs the KV entry of each new image and text passage: the replica asks the LLM worker
deployment (`LLMWorker.make_entry` for an image, `LLMWorker.make_document_entry` for a passage),
so the entries are computed by the serving engine on the serving model and written once to the
shared object store.
"""

from __future__ import annotations

from typing import Any

from ray.serve.handle import DeploymentHandle

from mpic.addressing import library_fingerprint
from mpic.deployments.client_errors import raising
from mpic.deployments.config import ServeAppConfig
from mpic.deployments.monitoring.replica_logs import use_serve_logging
from mpic.retriever.query import retrieve
from mpic.retriever.service import RetrievalService
from mpic.retriever.sources import open_source, read_captions
from mpic.retriever.spec import RetrievalSpec
from mpic.storage.entry_store import EntryStore
from mpic.storage.static_library import media_key
from mpic.types import CacheEntry


class Retriever:
    """Search and admin routes of the dynamic library."""

    def __init__(self, config: ServeAppConfig, worker: DeploymentHandle) -> None:
        use_serve_logging()
        entries = EntryStore.from_config(
            config.store.model_copy(update={"memory_bytes": 0, "disk_cache_dir": None})
        )
        self.service = RetrievalService(entries.objects, entries)
        self.system_prompt = config.engine.system_prompt
        self.worker = raising(worker)

    def search(
        self,
        spec: RetrievalSpec,
        query: str,
        images: list[bytes] | None = None,
        image_hashes: list[str] | None = None,
    ) -> list[tuple[str, str, str]]:
        """(entry key, media sha256, media type: "image" or "document") of the hits `spec`
        links for a query of text and/or images (inline image bytes, or the sha256 of uploaded
        images, read from the store here), best first."""
        pictures = list(images or [])
        pictures += [self.service.objects.get(media_key(h)) for h in image_hashes or []]
        found = retrieve(self.service, spec, text=query, images=pictures)
        return [(h.entry_key, h.content_hash, h.media_type) for h in found.hits if h.entry_key]

    def last_refreshed(self) -> str | None:
        """The collection an admin refreshed last (None: none yet): what `"retrieval": "auto"`
        searches when the config names no `default_collection`."""
        return self.service.last_refreshed()

    def collections(self) -> dict[str, Any]:
        """Collections with their current version and its item count."""
        rows = []
        for name in self.service.collections():
            current = self.service.versions(name)[1]
            items = len(self.service.library(name).manifest(current).items) if current else 0
            rows.append({"collection": name, "current": current, "items": items})
        return {"object": "list", "data": rows}

    def versions(self, collection: str) -> dict[str, Any]:
        """Versions of one collection, oldest first (404 for an unknown collection)."""
        versions, current = self.service.versions(collection)
        return {"collection": collection, "versions": versions, "current": current}

    def refresh(self, collection: str, source: str, captions: str | None) -> dict[str, Any]:
        """Build and swap in a new version from a folder or S3 prefix (sync: runs in a thread)."""
        fingerprint = self.worker.fingerprint.remote().result()

        def make_entry(media: bytes) -> CacheEntry:
            return self.worker.make_entry.remote(media).result()

        def make_document_entry(text: str) -> CacheEntry:
            return self.worker.make_document_entry.remote(text).result()

        report = self.service.refresh(
            collection,
            open_source(source),
            make_entry,
            model_fingerprint=library_fingerprint(fingerprint, self.system_prompt),
            captions=read_captions(captions),
            compute_document=make_document_entry,
        )
        return {
            "collection": report.collection,
            "version": report.version,
            "parent": report.parent,
            "items": report.items,
            "computed": report.computed,
            "reused": report.reused,
            "removed": report.removed,
            "documents": report.documents,
        }

    def rollback(self, collection: str, version: str) -> dict[str, Any]:
        """Make an earlier version current again (404 for an unknown one)."""
        manifest = self.service.rollback(collection, version)
        return {"collection": collection, "current": manifest.version}
