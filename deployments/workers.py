"""The Encoder and LLM-worker deployments (Serve replicas that hold a model).

Encoder: image bytes -> `EncodedImage` (content hash + input embeddings [T, hidden]); its result
travels to the worker as a Ray ObjectRef (zero-copy inside a node), never through HTTP.
LLMWorker: computes an upload's entry and registers it in the static library (entries are
written through to the object store, so other nodes read them by key), and generates from a
`LinkedPrompt`: it loads the linked entries through the tiered entry store (memory -> disk ->
object store), recomputes any entry that is lost or corrupt from its stored media (a fallback),
and streams the engine's `TokenEvent`s and final `DoneEvent`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import ray

from mpic.deployments.config import ServeAppConfig
from mpic.deployments.engine import (
    DoneEvent,
    EncodedImage,
    LinkedPrompt,
    Segment,
    TokenEvent,
    build_engine,
)
from mpic.deployments.files import file_object, open_library
from mpic.deployments.schemas import FileObject
from mpic.errors import CorruptEntryError, InvalidRequestError
from mpic.storage.entry_store import EntryStore
from mpic.storage.object_store import ObjectNotFoundError
from mpic.storage.static_library import media_key
from mpic.types import CacheEntry

logger = logging.getLogger(__name__)


class Encoder:
    """Vision tower + projector behind `POST /v1/files` and inline images."""

    def __init__(self, config: ServeAppConfig) -> None:
        self.engine = build_engine(config.engine, config.store)

    def encode(self, image_bytes: bytes) -> EncodedImage:
        """Decode (415 if not an image) and encode one image."""
        return self.engine.encode_image(image_bytes)


class LLMWorker:
    """The engine that owns KV: caches uploads and runs linked prefill + decode."""

    def __init__(self, config: ServeAppConfig) -> None:
        self.engine = build_engine(config.engine, config.store)
        self.entries = EntryStore.from_config(config.store)
        self.library = open_library(config.store, self.entries)

    def upload(
        self, user: str, name: str, media: bytes, image: EncodedImage, ttl_s: float | None
    ) -> FileObject:
        """Compute `image`'s canonical KV and register the file in `user`'s namespace."""
        entry = self.engine.compute_entry(self.engine.entry_id(image.content_hash), image)
        rec = self.library.add_file(
            user, name=name, media_type=image.media_type, media=media, entry=entry, ttl_s=ttl_s
        )
        return file_object(rec)

    def check_policy(self, policy: str) -> None:
        """InvalidRequestError (400) for an unknown policy name."""
        self.engine.check_policy(policy)

    def generate(self, prompt: LinkedPrompt) -> Iterator[TokenEvent | DoneEvent]:
        """Stream the answer to `prompt` (inline images arrive as ObjectRefs and are fetched)."""
        for turn in prompt.turns:
            for seg in turn.segments:
                if isinstance(seg.embeds, ray.ObjectRef):
                    seg.embeds = ray.get(seg.embeds)
        hashes = {s.entry_id: s for t in prompt.turns for s in t.segments if s.kind == "entry"}
        entries: dict[str, CacheEntry] = {}
        tiers: dict[str, int] = {}
        fallbacks = 0
        for entry_id, seg in hashes.items():
            tier = self.entries.locate(entry_id)
            try:
                if tier is None:
                    raise ObjectNotFoundError(entry_id)
                entries[entry_id] = self.entries.get(entry_id)
                tiers[tier] = tiers.get(tier, 0) + 1
            except (ObjectNotFoundError, CorruptEntryError):
                logger.warning("entry %s lost or corrupt: recomputing from media", entry_id)
                entries[entry_id] = self._recompute(seg)
                fallbacks += 1
        for ev in self.engine.generate(prompt, entries):
            if isinstance(ev, DoneEvent):
                ev.tier_hits, ev.fallbacks = tiers, fallbacks
            yield ev

    def _recompute(self, seg: Segment) -> CacheEntry:
        try:
            media = self.entries.objects.get(media_key(seg.content_hash))
        except ObjectNotFoundError:
            raise InvalidRequestError(f"entry {seg.entry_id} and its media are gone") from None
        image = self.engine.encode_image(media)
        entry = self.engine.compute_entry(seg.entry_id, image)
        self.entries.put(entry)
        return entry
