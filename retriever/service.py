"""The retriever (MPIC section 3.1, component 4: the "relocation table" that finds references in
the dynamic library): search, refresh, list, versions and rollback over the collections of one
object store. Runs in the admin CLI process and inside the Retriever Serve replica
(`mpic.deployments`), which wraps one `RetrievalService`.

Every search reads the collection's CURRENT pointer (one small GET) and answers from exactly that
immutable version: its manifest and FAISS index are loaded once and cached by version id, so a
refresh or rollback swapping CURRENT is picked up by the next search and a search never mixes
two versions. Thread-safe.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, Field

from mpic.errors import InvalidRequestError, NotFoundError
from mpic.retriever.embedder import ClipEmbedder, EmbedderConfig
from mpic.retriever.index import IndexConfig, VectorIndex
from mpic.retriever.refresh import (
    INDEX_BLOB,
    ComputeDocument,
    ComputeEntry,
    RefreshReport,
    refresh_collection,
)
from mpic.retriever.sources import MediaSource
from mpic.storage.dynamic_library import DynamicLibrary, Manifest, ManifestItem
from mpic.storage.entry_store import EntryStore
from mpic.storage.object_store import ObjectStore

logger = logging.getLogger(__name__)


class Hit(BaseModel):
    """One retrieved reference, linkable by `entry_key` (its cached KV)."""

    item_id: str = Field(description="Item id in the collection version.")
    score: float = Field(description="Cosine similarity to the query (higher is closer).")
    entry_key: str | None = Field(description="Content address of the item's KV cache entry.")
    content_hash: str | None = Field(description="sha256 of the media bytes.")
    media_key: str | None = Field(description="Object key of the media bytes.")
    media_type: str = Field(
        "image", description='"image", or "document" for a text passage (linked as a document).'
    )
    name: str = Field("", description="File name in the refresh source.")
    caption: str = Field("", description="Caption from the captions JSONL.")


class SearchResult(BaseModel):
    """Hits of one query, best first, all from `version`."""

    collection: str = Field(description="Collection searched.")
    version: str = Field(description="The one version every hit comes from.")
    hits: list[Hit] = Field(description="Best first.")


@dataclass(frozen=True)
class LoadedVersion:
    """A collection version ready to search: manifest, index, FAISS id -> item."""

    manifest: Manifest
    index: VectorIndex
    by_vector_id: dict[int, ManifestItem]


class RetrievalService:
    """Collections of one object store; `entries` holds the KV entries a refresh writes."""

    def __init__(
        self,
        objects: ObjectStore,
        entries: EntryStore | None = None,
        embedder_cfg: EmbedderConfig | None = None,
        index_cfg: IndexConfig | None = None,
    ):
        self.objects = objects
        self.entries = entries or EntryStore(objects)
        self.embedder_cfg = embedder_cfg or EmbedderConfig()
        self.index_cfg = index_cfg or IndexConfig()
        self._lock = threading.Lock()
        self._loaded: dict[str, LoadedVersion] = {}
        self._embedders: dict[str, ClipEmbedder] = {}

    def library(self, collection: str) -> DynamicLibrary:
        """The dynamic library of `collection` (InvalidRequestError for a bad name)."""
        try:
            return DynamicLibrary(self.objects, collection, entries=self.entries)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="collection") from exc

    def collections(self) -> list[str]:
        """Names of the collections that have a current version."""
        return sorted(
            k.split("/")[1]
            for k in self.objects.list("dynamic/")
            if k.count("/") == 2 and k.endswith("/CURRENT")
        )

    def embedder(self, cfg: EmbedderConfig | None = None) -> ClipEmbedder:
        """The embedder built from `cfg` (default: this retriever's), cached per config."""
        cfg = cfg or self.embedder_cfg
        key = json.dumps(cfg.model_dump(), sort_keys=True)
        with self._lock:
            if key not in self._embedders:
                self._embedders[key] = ClipEmbedder(cfg, get_bytes=self.objects.get)
            return self._embedders[key]

    def load(self, collection: str) -> LoadedVersion:
        """The current version of `collection`; NotFoundError if it has none."""
        lib = self.library(collection)
        version = lib.current_version()
        if version is None:
            raise NotFoundError(f"unknown collection {collection!r}", param="collection")
        with self._lock:
            cached = self._loaded.get(collection)
        if cached is not None and cached.manifest.version == version:
            return cached
        manifest = lib.manifest(version)
        index = VectorIndex.from_bytes(
            lib.get_blob(manifest, INDEX_BLOB), IndexConfig(**manifest.extra["index"])
        )
        by_id = {int(it.extra["vector_id"]): it for it in manifest.items}
        loaded = LoadedVersion(manifest, index, by_id)
        with self._lock:
            self._loaded[collection] = loaded
        return loaded

    def search(
        self,
        collection: str,
        *,
        text: str | None = None,
        image: bytes | None = None,
        images: list[bytes] | None = None,
        top_k: int = 5,
        min_score: float | None = None,
    ) -> SearchResult:
        """The `top_k` items of the current version closest to a query of text, image(s) or
        both: images and text passages alike (one index in CLIP's shared space; `Hit.media_type`
        says which). Several query embeddings e_i (unit vectors) are combined into one query
        q = sum_i e_i / ||sum_i e_i||, so an image and its question weigh alike."""
        pictures = [*([image] if image is not None else []), *(images or [])]
        if text is None and not pictures:
            raise InvalidRequestError("give a text or an image query")
        loaded = self.load(collection)
        embedder = self.embedder(EmbedderConfig(**loaded.manifest.extra["embedder"]))
        parts = []
        if text is not None:
            parts.append(embedder.embed_texts([text]))
        if pictures:
            parts.append(embedder.embed_images(pictures))
        query = np.concatenate(parts).astype(np.float32).sum(axis=0)
        query /= max(float(np.linalg.norm(query)), 1e-12)
        return self.search_vector(loaded, query, top_k, min_score)

    def last_refreshed(self) -> str | None:
        """The collection whose newest version is the most recent (version ids sort by commit
        time): the one an admin refreshed last; None when there is none."""
        newest = {}
        for name in self.collections():
            versions = self.library(name).versions()
            if versions:
                newest[name] = versions[-1]
        return max(newest, key=newest.__getitem__) if newest else None

    def search_vector(
        self, loaded: LoadedVersion, query: np.ndarray, top_k: int, min_score: float | None = None
    ) -> SearchResult:
        """Search one version with a unit query vector float32 [d]."""
        scores, ids = loaded.index.search(query[None], top_k)
        hits = []
        for score, vid in zip(scores[0], ids[0], strict=True):
            if vid < 0 or (min_score is not None and score < min_score):
                continue
            it = loaded.by_vector_id[int(vid)]
            hits.append(
                Hit(
                    item_id=it.item_id,
                    score=float(score),
                    entry_key=it.entry_key,
                    content_hash=it.content_hash,
                    media_key=it.media_key,
                    media_type=it.media_type,
                    name=it.extra.get("name", ""),
                    caption=it.caption,
                )
            )
        m = loaded.manifest
        return SearchResult(collection=m.collection, version=m.version, hits=hits)

    def refresh(
        self,
        collection: str,
        source: MediaSource,
        compute_entry: ComputeEntry,
        *,
        model_fingerprint: str,
        captions: dict[str, str] | None = None,
        progress: bool = False,
        compute_document: ComputeDocument | None = None,
    ) -> RefreshReport:
        """New current version of `collection` from `source` (see `mpic.retriever.refresh`):
        `compute_entry` computes an image's entry, `compute_document` a text passage's."""
        return refresh_collection(
            self.library(collection),
            source,
            compute_entry,
            model_fingerprint=model_fingerprint,
            embedder=self.embedder(),
            index_cfg=self.index_cfg,
            captions=captions,
            progress=progress,
            compute_document=compute_document,
        )

    def versions(self, collection: str) -> tuple[list[str], str | None]:
        """(committed versions oldest first, current version); NotFoundError if none."""
        lib = self.library(collection)
        versions = lib.versions()
        if not versions:
            raise NotFoundError(f"unknown collection {collection!r}", param="collection")
        return versions, lib.current_version()

    def prune(self, collection: str, keep: int) -> list[str]:
        """Release all but the newest `keep` versions (CURRENT is always kept); returns the
        released ones. Their entries and media are freed by the storage sweeper once no other
        version or file references them."""
        if keep < 1:
            raise InvalidRequestError("keep must be >= 1", param="keep")
        versions, current = self.versions(collection)
        lib = self.library(collection)
        released = [v for v in versions[:-keep] if v != current]
        for version in released:
            lib.release_version(version)
        return released

    def rollback(self, collection: str, version: str) -> Manifest:
        """Make a kept `version` current again; NotFoundError for an unknown one."""
        self.versions(collection)
        return self.library(collection).rollback(version)
