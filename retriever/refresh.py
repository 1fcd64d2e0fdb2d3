"""Dynamic-library refresh (MPIC section 3.1, component 3: "the administrator of MPIC can update
the references periodically"): a folder or S3 prefix of images and text passages (.txt/.md)
becomes a new immutable version of a collection (media, KV cache entries, CLIP vectors in one
FAISS index), swapped in atomically. Runs in the admin CLI process (`mpic-admin library refresh`)
or the Retriever Serve replica.

Steps: hash every file (sha256) and de-duplicate by content; embed the new items (all of them
decode before anything is written: images by CLIP's image tower, passages, UTF-8 text, by its
text tower, `ClipEmbedder.embed_passages`); compute the KV entry of each new item through the
injected engine calls, `compute_entry(image_bytes) -> CacheEntry` for an image and
`compute_document(text) -> CacheEntry` for a passage (the engine's document entry, as for an
uploaded .txt file); build the index; commit through `mpic.storage.dynamic_library` (manifest
written last, CURRENT swapped in one PUT). Items carry their `media_type`, "image" or
"document". Incremental: an item whose bytes (and kind) are unchanged since the current version
keeps its entry and vector (no engine call, no re-embedding) as long as the model and embedder
fingerprints match; items no longer in the source are not in the new version. Any exception
aborts the version (its blobs are deleted); a killed process leaves only unreferenced blobs and
no manifest, so the old version stays current and nothing half-built is visible.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from mpic.documents import decode_document
from mpic.errors import InvalidRequestError, PromptTooLongError, UnreadableMediaError
from mpic.retriever.embedder import ClipEmbedder
from mpic.retriever.index import IndexConfig, VectorIndex
from mpic.retriever.sources import MediaSource, media_type
from mpic.storage.dynamic_library import DynamicLibrary, Manifest, ManifestItem
from mpic.types import CacheEntry

logger = logging.getLogger(__name__)

INDEX_BLOB = "faiss.index"
ComputeEntry = Callable[[bytes], CacheEntry]
"""The engine's entry of an image: encoded image bytes -> CacheEntry."""
ComputeDocument = Callable[[str], CacheEntry]
"""The engine's entry of a text passage: its text -> CacheEntry (the document recipe)."""


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
    """(name, name of the identical file kept) for each de-duplicated file."""
    documents: int = 0
    """Items of the new version that are text passages (the others are images)."""


@dataclass
class _Item:
    """One distinct file of the source: an image or a text passage ("document")."""

    name: str
    content_hash: str
    aliases: list[str]
    media_type: str = "image"

    @property
    def key(self) -> tuple[str, str]:
        """What an unchanged item is recognised by in the current version."""
        return self.content_hash, self.media_type


def _read(source: MediaSource, im: _Item) -> bytes:
    """The file's bytes, checked against the hash taken by `_scan`."""
    data = source.read(im.name)
    if hashlib.sha256(data).hexdigest() != im.content_hash:
        raise InvalidRequestError(
            f"{im.name} changed during the refresh; run it again", param="source"
        )
    return data


def _scan(source: MediaSource, progress: bool) -> tuple[list[_Item], list[tuple[str, str]]]:
    """Hash every file, keep the first name of each distinct content."""
    by_hash: dict[str, _Item] = {}
    duplicates = []
    for name in tqdm(source.names, desc="hash", unit="img", disable=not progress):
        digest = hashlib.sha256(source.read(name)).hexdigest()
        if digest in by_hash:
            by_hash[digest].aliases.append(name)
            duplicates.append((name, by_hash[digest].name))
        else:
            by_hash[digest] = _Item(name, digest, [], media_type(name) or "image")
    return list(by_hash.values()), duplicates


def _previous(
    lib: DynamicLibrary, prev: Manifest | None, embedder: ClipEmbedder, model_fingerprint: str
) -> tuple[dict[tuple[str, str], ManifestItem], VectorIndex | None]:
    """Items of the current version whose entries can be reused (by content hash and kind), and
    its index if its vectors can (same embedder)."""
    if prev is None:
        return {}, None
    items = {}
    if prev.extra.get("model_fingerprint") == model_fingerprint:
        items = {
            (it.content_hash, it.media_type): it
            for it in prev.items
            if it.content_hash and it.entry_key
        }
    index = None
    if prev.extra.get("embedder_fingerprint") == embedder.fingerprint and INDEX_BLOB in prev.blobs:
        index = VectorIndex.from_bytes(
            lib.get_blob(prev, INDEX_BLOB), IndexConfig(**prev.extra["index"])
        )
    return items, index


def _text(source: MediaSource, im: _Item) -> str:
    """A passage's text (UnreadableMediaError naming it unless UTF-8)."""
    return decode_document(_read(source, im), im.name)


def _embed(
    images: list[_Item],
    source: MediaSource,
    embedder: ClipEmbedder,
    old_index: VectorIndex | None,
    old_keys: set[tuple[str, str]],
    progress: bool,
) -> dict[str, np.ndarray]:
    """content hash -> unit vector float32 [d]: reconstructed from `old_index` for items it
    holds, embedded in batches otherwise, images by the image tower and passages by the text
    tower (UnreadableMediaError naming a file that does not decode: an image that is not one,
    a passage that is not UTF-8; InvalidRequestError for an empty passage)."""
    vectors = {}
    if old_index is not None:
        vectors = {
            im.content_hash: old_index.reconstruct(vector_id(im.content_hash))
            for im in images
            if im.key in old_keys
        }
    todo = [im for im in images if im.content_hash not in vectors]
    batch = embedder.cfg.batch_size
    for start in tqdm(range(0, len(todo), batch), desc="embed", unit="batch", disable=not progress):
        chunk = todo[start : start + batch]
        pics = [im for im in chunk if im.media_type != "document"]
        docs = [im for im in chunk if im.media_type == "document"]
        embs = embedder.embed_images([_read(source, im) for im in pics], [im.name for im in pics])
        vectors.update((im.content_hash, e) for im, e in zip(pics, embs, strict=True))
        texts = [_text(source, im) for im in docs]
        embs = embedder.embed_passages(texts, [im.name for im in docs])
        vectors.update((im.content_hash, e) for im, e in zip(docs, embs, strict=True))
    return vectors


def _named(name: str, compute: Callable[[], CacheEntry]) -> CacheEntry:
    """`compute()`, its input errors (an empty or too long passage...) naming the file."""
    try:
        return compute()
    except (InvalidRequestError, UnreadableMediaError) as exc:
        kind = next(
            k
            for k in (PromptTooLongError, InvalidRequestError, UnreadableMediaError)
            if isinstance(exc, k)
        )
        raise kind(f"{name}: {getattr(exc, 'message', exc)}", param="source") from exc


def refresh_collection(
    lib: DynamicLibrary,
    source: MediaSource,
    compute_entry: ComputeEntry,
    *,
    model_fingerprint: str,
    embedder: ClipEmbedder,
    index_cfg: IndexConfig,
    captions: dict[str, str] | None = None,
    progress: bool = True,
    compute_document: ComputeDocument | None = None,
) -> RefreshReport:
    """Build, commit and make current a new version of `lib` from `source` (see module doc).

    Raises, with nothing written: UnreadableMediaError when an image does not decode or a
    passage is not UTF-8, InvalidRequestError for an empty passage or for new passages without
    a `compute_document`. Any error of `compute_entry` / `compute_document` aborts the version
    and leaves the current one in place (input errors, e.g. a passage longer than the model's
    context, name the file).
    """
    captions = captions or {}
    prev = lib.current()
    images, duplicates = _scan(source, progress)
    old_items, old_index = _previous(lib, prev, embedder, model_fingerprint)
    fresh = [im for im in images if im.key not in old_items]
    new_docs = [im.name for im in fresh if im.media_type == "document"]
    if new_docs and compute_document is None:
        raise InvalidRequestError(
            f"{new_docs[0]}: this engine does not cache text passages", param="source"
        )
    old_keys = {(it.content_hash, it.media_type) for it in prev.items} if prev else set()
    vectors = _embed(images, source, embedder, old_index, old_keys, progress)

    def meta(im: _Item) -> dict:
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
        for im in tqdm(images, desc="KV entries", unit="item", disable=not progress):
            old = old_items.get(im.key)
            if old is not None:  # unchanged item, same model: reuse its entry and media
                builder.items[old.item_id] = old.model_copy(update=meta(im))
                continue
            data = _read(source, im)
            if im.media_type == "document":
                text = decode_document(data, im.name)
                entry = _named(im.name, lambda text=text: compute_document(text))
            else:
                entry = compute_entry(data)
            builder.put_item(
                im.content_hash[:16],
                media=data,
                media_type=im.media_type,
                entry=entry,
                **meta(im),
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
    removed = len(old_keys - {im.key for im in images})
    report = RefreshReport(
        lib.collection,
        manifest.version,
        manifest.parent,
        len(images),
        len(fresh),
        reused,
        removed,
        duplicates,
        documents=sum(im.media_type == "document" for im in images),
    )
    logger.info("refreshed %s", report)
    return report
