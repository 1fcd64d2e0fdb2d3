"""Dynamic library: named collections of references for MRAG with immutable versions, a CURRENT
pointer swapped atomically, and rollback (MPIC section 3.1 component (3): "the administrator of
MPIC can update the references periodically"). Runs in the admin CLI (refresh) and in Serve
replicas (readers of CURRENT).

Layout in the object store:
  dynamic/<collection>/versions/<version>/manifest.json   immutable manifest (commit point)
  dynamic/<collection>/versions/<version>/blobs/<name>    extra blobs (e.g. a FAISS index)
  dynamic/<collection>/CURRENT                            {"version": ...}, one atomic PUT
  media/<sha256>, entries/<key>                           shared with the static library
A version becomes visible only when its manifest exists (written after every blob, entry and
reference marker), and current only when CURRENT is replaced, so readers never see half a refresh.
Concurrent committers each get a distinct version; the last CURRENT swap wins.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from mpic.errors import NotFoundError
from mpic.storage import refs
from mpic.storage.entry_store import EntryStore, entry_object_key
from mpic.storage.object_store import ObjectNotFoundError, ObjectStore, check_key
from mpic.storage.static_library import media_key
from mpic.types import CacheEntry

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ManifestItem(BaseModel):
    """One reference of a collection version."""

    model_config = ConfigDict(extra="forbid")

    item_id: str = Field(description="Stable id of the reference inside the collection.")
    content_hash: str | None = Field(None, description="sha256 hex of the media bytes.")
    media_key: str | None = Field(None, description="Object key of the original media.")
    media_type: str = Field(
        "image", description='Kind of media: "image", or "document" (a text passage).'
    )
    entry_key: str | None = Field(None, description="Content address of the KV entry.")
    token_count: int | None = Field(None, description="Tokens the item occupies.")
    caption: str = Field("", description="Text stored with the reference.")
    extra: dict[str, Any] = Field(default_factory=dict, description="Free-form metadata.")


class Manifest(BaseModel):
    """An immutable collection version."""

    model_config = ConfigDict(extra="forbid")

    collection: str = Field(description="Collection name.")
    version: str = Field(description="Sortable version id (UTC time + random suffix).")
    parent: str | None = Field(None, description="Version this one was built from.")
    created_at: float = Field(description="Commit time, seconds since the epoch.")
    items: list[ManifestItem] = Field(default_factory=list, description="References, in order.")
    blobs: dict[str, str] = Field(default_factory=dict, description="Blob name -> object key.")
    extra: dict[str, Any] = Field(default_factory=dict, description="Free-form metadata.")

    def item(self, item_id: str) -> ManifestItem:
        """The item with this id; NotFoundError otherwise."""
        for it in self.items:
            if it.item_id == item_id:
                return it
        raise NotFoundError(f"No item {item_id!r} in {self.collection}@{self.version}")


class VersionBuilder:
    """A version being written: put items and blobs, then `commit` (or `abort`). Use as a
    context manager to abort automatically when the block raises."""

    def __init__(self, lib: DynamicLibrary, base: Manifest | None) -> None:
        self.lib = lib
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        self.version = f"v{stamp}-{secrets.token_hex(3)}"
        self.parent = base.version if base else None
        self.items: dict[str, ManifestItem] = {i.item_id: i for i in base.items} if base else {}
        self.blobs: dict[str, str] = {}
        self.extra: dict[str, Any] = dict(base.extra) if base else {}
        self._holder = f"dyn.{lib.collection}.{self.version}"
        self._done = False

    def _ref(self, blob_key: str) -> None:
        refs.add_ref(self.lib.objects, blob_key, self._holder)

    def put_item(
        self,
        item_id: str,
        *,
        media: bytes | None = None,
        media_type: str = "image",
        entry: CacheEntry | None = None,
        caption: str = "",
        extra: dict[str, Any] | None = None,
    ) -> ManifestItem:
        """Add or replace an item; stores its media and KV entry (if given) right away."""
        item = ManifestItem(
            item_id=item_id, media_type=media_type, caption=caption, extra=extra or {}
        )
        if media is not None:
            item.content_hash = hashlib.sha256(media).hexdigest()
            item.media_key = media_key(item.content_hash)
            self.lib.objects.put(item.media_key, media)
            self._ref(item.media_key)
        if entry is not None:
            if self.lib.entries is None:
                raise ValueError("this DynamicLibrary has no EntryStore to hold entries")
            item.entry_key = self.lib.entries.put(entry)
            item.token_count = entry.num_tokens
            self._ref(entry_object_key(item.entry_key))
        self.items[item_id] = item
        return item

    def remove_item(self, item_id: str) -> None:
        """Drop an item carried over from the base version."""
        self.items.pop(item_id, None)

    def put_blob(self, name: str, data: bytes) -> str:
        """Store an extra blob (e.g. serialized FAISS index) in this version; returns its key."""
        key = f"{self.lib.prefix}versions/{self.version}/blobs/{check_key(name)}"
        self.lib.objects.put(key, data)
        self.blobs[name] = key
        return key

    def commit(self, make_current: bool = True) -> Manifest:
        """Reference every item, write the manifest, then (optionally) swap CURRENT to it."""
        for item in self.items.values():
            for blob in (item.media_key, item.entry_key and entry_object_key(item.entry_key)):
                if blob:
                    self._ref(blob)
        man = Manifest(
            collection=self.lib.collection,
            version=self.version,
            parent=self.parent,
            created_at=time.time(),
            items=list(self.items.values()),
            blobs=self.blobs,
            extra=self.extra,
        )
        self.lib.objects.put_json(self.lib.manifest_key(self.version), man.model_dump())
        self._done = True
        if make_current:
            self.lib.set_current(self.version)
        return man

    def abort(self) -> None:
        """Forget the version: delete its blobs and release its references."""
        self.lib.release_version(self.version)
        self._done = True

    def __enter__(self) -> VersionBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:  # noqa: ANN001
        if exc_type is not None and not self._done:
            self.abort()


class DynamicLibrary:
    """Versioned collection `collection`: begin/commit versions, CURRENT, list, rollback."""

    def __init__(
        self, objects: ObjectStore, collection: str, entries: EntryStore | None = None
    ) -> None:
        if not _NAME.match(collection):
            raise ValueError(f"collection name {collection!r}: use 1-64 of [A-Za-z0-9_-]")
        self.objects, self.collection, self.entries = objects, collection, entries
        self.prefix = f"dynamic/{collection}/"

    def manifest_key(self, version: str) -> str:
        """Object key of a version's manifest."""
        return f"{self.prefix}versions/{check_key(version)}/manifest.json"

    def begin_version(self, base: str | None = "current") -> VersionBuilder:
        """Start a version holding the items of `base` ('current', a version id, or None)."""
        if base == "current":
            return VersionBuilder(self, self.current())
        return VersionBuilder(self, self.manifest(base) if base else None)

    def manifest(self, version: str) -> Manifest:
        """A committed version's manifest; NotFoundError otherwise."""
        try:
            return Manifest.model_validate(self.objects.get_json(self.manifest_key(version)))
        except (ObjectNotFoundError, ValueError):
            raise NotFoundError(f"No version {version!r} of {self.collection}") from None

    def versions(self) -> list[str]:
        """Committed versions, oldest first."""
        tail = "/manifest.json"
        keys = self.objects.list(f"{self.prefix}versions/")
        return sorted(k.split("/")[-2] for k in keys if k.endswith(tail))

    def current_version(self) -> str | None:
        """The version CURRENT points at, or None before the first commit."""
        try:
            return self.objects.get_json(f"{self.prefix}CURRENT")["version"]
        except ObjectNotFoundError:
            return None

    def current(self) -> Manifest | None:
        """The current manifest, or None before the first commit."""
        version = self.current_version()
        return self.manifest(version) if version else None

    def set_current(self, version: str) -> Manifest:
        """Point CURRENT at a committed version (one atomic PUT); used by commit and rollback."""
        man = self.manifest(version)
        self.objects.put_json(f"{self.prefix}CURRENT", {"version": version})
        return man

    def rollback(self, version: str) -> Manifest:
        """Make an earlier committed version current again (its manifest is immutable)."""
        return self.set_current(version)

    def get_blob(self, manifest: Manifest, name: str) -> bytes:
        """An extra blob of a version; NotFoundError if the version has no such blob."""
        if name not in manifest.blobs:
            raise NotFoundError(f"No blob {name!r} in {self.collection}@{manifest.version}")
        return self.objects.get(manifest.blobs[name])

    def release_version(self, version: str) -> None:
        """Delete a version that is not current (manifest, blobs, references); blobs no longer
        referenced are collected by the sweeper."""
        if version == self.current_version():
            raise ValueError(f"{version} is CURRENT; roll back before deleting it")
        self.objects.delete(self.manifest_key(version))
        holder = f"dyn.{self.collection}.{version}"
        for key in list(self.objects.list(f"{self.prefix}versions/{version}/")):
            self.objects.delete(key)
        for key in list(self.objects.list(refs.REFS)):
            if key.endswith("/" + holder):
                refs.drop_ref(self.objects, key[len(refs.REFS) : -len(holder) - 1], holder)
