"""Dynamic-library refresh (MPIC section 3.1, component 3: "the administrator of MPIC can update
the references periodically"): a folder or S3 prefix of images becomes a new immutable version of
a collection (media, KV cache entries, CLIP vectors in a FAISS index), swapped in atomically.
Runs in the admin CLI process (`mpic-admin library refresh`) or the Retriever Serve replica.

Steps: hash every image (sha256) and de-duplicate by content; embed the new images (all of them
decode before anything is written); compute the KV entry of each new image through the injected
`compute_entry(image_bytes) -> CacheEntry` (the engine); build the index; commit through
`mpic.storage.dynamic_library` (manifest written last, CURRENT swapped in one PUT). Incremental:
an image whose bytes are unchanged since the current version keeps its entry and vector (no
engine call, no re-embedding) as long as the model and embedder fingerprints match; images no
longer in the source are not in the new version. Any exception aborts the version (its blobs
are deleted); a killed process leaves only unreferenced blobs and no manifest, so the old
version stays current and nothing half-built is visible.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from mpic.errors import InvalidRequestError
from mpic.retriever.embedder import ClipEmbedder
from mpic.retriever.index import IndexConfig, VectorIndex
from mpic.retriever.sources import ImageSource
from mpic.storage.dynamic_library import DynamicLibrary, Manifest, ManifestItem
from mpic.types import CacheEntry

logger = logging.getLogger(__name__)

INDEX_BLOB = "faiss.index"
ComputeEntry = Callable[[bytes], CacheEntry]


def vector_id(content_hash: str) -> int:
    """The FAISS id of an item: the first 60 bits of its sha256 (stable across versions)."""
    return int(content_hash[:15], 16)


@dataclass
class RefreshReport:
    """What a refresh did; `computed` counts engine calls, `reused` items carried over."""

    collection: str
    version: str
    parent: str | None
    items: int
    computed: int
    reused: int
    removed: int
    duplicates: list[tuple[str, str]] = field(default_factory=list)
    """(name, name of the identical image kept) for each de-duplicated file."""


@dataclass
class _Image:
    name: str
    content_hash: str
    aliases: list[str]


def _read(source: ImageSource, im: _Image) -> bytes:
    """The image's bytes, checked against the hash taken by `_scan`."""
    data = source.read(im.name)
    if hashlib.sha256(data).hexdigest() != im.content_hash:
        raise InvalidRequestError(
            f"{im.name} changed during the refresh; run it again", param="source"
        )
    return data


def _scan(source: ImageSource, progress: bool) -> tuple[list[_Image], list[tuple[str, str]]]:
    """Hash every image, keep the first name of each distinct content."""
    by_hash: dict[str, _Image] = {}
    duplicates = []
    for name in tqdm(source.names, desc="hash", unit="img", disable=not progress):
        digest = hashlib.sha256(source.read(name)).hexdigest()
        if digest in by_hash:
            by_hash[digest].aliases.append(name)
            duplicates.append((name, by_hash[digest].name))
        else:
            by_hash[digest] = _Image(name, digest, [])
    return list(by_hash.values()), duplicates


def _previous(
    lib: DynamicLibrary, prev: Manifest | None, embedder: ClipEmbedder, model_fingerprint: str
) -> tuple[dict[str, ManifestItem], VectorIndex | None]:
    """Items of the current version whose entries can be reused (by content hash), and its index
    if its vectors can (same embedder)."""
    if prev is None:
        return {}, None
    items = {}
    if prev.extra.get("model_fingerprint") == model_fingerprint:
        items = {it.content_hash: it for it in prev.items if it.content_hash and it.entry_key}
    index = None
    if prev.extra.get("embedder_fingerprint") == embedder.fingerprint and INDEX_BLOB in prev.blobs:
        index = VectorIndex.from_bytes(
            lib.get_blob(prev, INDEX_BLOB), IndexConfig(**prev.extra["index"])
        )
    return items, index


def _embed(
    images: list[_Image],
    source: ImageSource,
    embedder: ClipEmbedder,
    old_index: VectorIndex | None,
    old_hashes: set[str],
    progress: bool,
) -> dict[str, np.ndarray]:
    """content hash -> unit vector float32 [d]: reconstructed from `old_index` for images it
    holds, embedded in batches otherwise (UnreadableMediaError if one does not decode)."""
    vectors = {}
    if old_index is not None:
        vectors = {
            im.content_hash: old_index.reconstruct(vector_id(im.content_hash))
            for im in images
            if im.content_hash in old_hashes
        }
    todo = [im for im in images if im.content_hash not in vectors]
    batch = embedder.cfg.batch_size
    for start in tqdm(range(0, len(todo), batch), desc="embed", unit="batch", disable=not progress):
        chunk = todo[start : start + batch]
        embs = embedder.embed_images([_read(source, im) for im in chunk], [im.name for im in chunk])
        vectors.update((im.content_hash, e) for im, e in zip(chunk, embs, strict=True))
    return vectors


def refresh_collection(
    lib: DynamicLibrary,
    source: ImageSource,
    compute_entry: ComputeEntry,
    *,
    model_fingerprint: str,
    embedder: ClipEmbedder,
    index_cfg: IndexConfig,
    captions: dict[str, str] | None = None,
    progress: bool = True,
) -> RefreshReport:
    """Build, commit and make current a new version of `lib` from `source` (see module doc).

    Raises UnreadableMediaError (nothing written) when an image does not decode; any error of
    `compute_entry` aborts the version and leaves the current one in place.
    """
    captions = captions or {}
    prev = lib.current()
    images, duplicates = _scan(source, progress)
    old_items, old_index = _previous(lib, prev, embedder, model_fingerprint)
    old_hashes = {it.content_hash for it in prev.items} if prev else set()
    vectors = _embed(images, source, embedder, old_index, old_hashes, progress)
    fresh = [im for im in images if im.content_hash not in old_items]

    def meta(im: _Image) -> dict:
        return {
            "caption": captions.get(im.name, ""),
            "extra": {
                "name": im.name,
                "aliases": im.aliases,
                "vector_id": vector_id(im.content_hash),
            },
        }

    with lib.begin_version(base=None) as builder:
        builder.parent = prev.version if prev else None
        for im in tqdm(images, desc="KV entries", unit="img", disable=not progress):
            old = old_items.get(im.content_hash)
            if old is not None:  # unchanged image, same model: reuse its entry and media
                builder.items[old.item_id] = old.model_copy(update=meta(im))
            else:
                data = _read(source, im)
                builder.put_item(
                    im.content_hash[:16], media=data, entry=compute_entry(data), **meta(im)
                )
        ids = np.array([vector_id(im.content_hash) for im in images], dtype=np.int64)
        if len(set(ids.tolist())) != len(ids):
            raise RuntimeError("60-bit content-hash prefix collision; refusing to index")
        matrix = np.stack([vectors[im.content_hash] for im in images])
        builder.put_blob(INDEX_BLOB, VectorIndex.build(matrix, ids, index_cfg).to_bytes())
        builder.extra.update(
            {
                "model_fingerprint": model_fingerprint,
                "embedder_fingerprint": embedder.fingerprint,
                "embedder": embedder.cfg.model_dump(),
                "index": index_cfg.model_dump(),
                "source": source.location,
            }
        )
        manifest = builder.commit(make_current=True)
    reused = len(images) - len(fresh)
    removed = len(old_hashes - {im.content_hash for im in images})
    report = RefreshReport(
        lib.collection,
        manifest.version,
        manifest.parent,
        len(images),
        len(fresh),
        reused,
        removed,
        duplicates,
    )
    logger.info("refreshed %s", report)
    return report
