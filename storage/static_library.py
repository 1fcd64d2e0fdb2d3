"""Static library: the files users upload, per-user namespaces, TTL and the sweeper (MPIC
section 3.1 component (2): "files from different users are logically separated. Each user can
access only his/her own files"; workflow step 1: caches are "deleted following the expiration of
their designated timeframe"). Runs in the Serve replica that handles /v1/files and in the
sweeper.

Layout in the object store:
  media/<sha256 of bytes>                      original media (kept to recompute lost KV)
  entries/<entry key>                          KV entry blob (via EntryStore)
  static/u/<user hash>/<file id>.json          the catalog record (visible = exists)
  refs/<blob key>/static.<user hash>.<file id> reference markers (refs.py)

Upload order: media, entry, markers, then the record: a crash before the record leaves only
unreferenced-by-any-record blobs for the sweeper, never a half-visible file. Identical content from
two users shares one media blob and one entry, but every upload does the same writes, a lookup
only reads inside the caller's own prefix, and another user's id answers exactly like an id that
never existed (`NotFoundError`), so no user can learn that another holds the same content.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from mpic.errors import ExpiredError, InvalidRequestError, NotFoundError
from mpic.storage import refs
from mpic.storage.keys import ENTRY_PREFIX, entry_object_key
from mpic.storage.object_store import ObjectNotFoundError, ObjectStore

if TYPE_CHECKING:  # torch-free at run time: the ingress opens a catalog-only library
    from mpic.storage.entry_store import EntryStore
    from mpic.types import CacheEntry

_FILE_ID = re.compile(r"^file-[A-Za-z0-9_-]{24}$")


class FileRecord(BaseModel):
    """Catalog record of one uploaded file (what the owner may see)."""

    model_config = ConfigDict(extra="forbid")

    file_id: str = Field(description="Opaque, unguessable id ('file-' + 24 url-safe chars).")
    name: str = Field(description="Client-given file name.")
    media_type: str = Field(description="MIME type, e.g. image/png.")
    purpose: Literal["vision", "user_data"] = Field(
        "vision", description="OpenAI upload purpose, reported back on the file object."
    )
    bytes: int = Field(description="Size of the original media.")
    token_count: int = Field(description="Tokens the item occupies in a prompt.")
    content_hash: str = Field(description="sha256 hex of the media bytes.")
    entry_key: str = Field(description="Content address of the KV entry.")
    created_at: float = Field(description="Upload time, seconds since the epoch.")
    expires_at: float = Field(description="Expiry time, seconds since the epoch.")
    status: Literal["active", "expired"] = Field("active", description="'expired' = tombstone.")

    @property
    def media_key(self) -> str:
        """Object key of the original media bytes."""
        return media_key(self.content_hash)


class SweepReport(BaseModel):
    """What one sweep did."""

    expired: list[str] = Field(default_factory=list, description="Files that expired now.")
    tombstones_removed: int = Field(0, description="Expired records forgotten.")
    blobs_deleted: list[str] = Field(default_factory=list, description="Blob keys deleted.")


def media_key(content_hash: str) -> str:
    """Object key of media with this sha256."""
    return f"media/{content_hash}"


class StaticLibrary:
    """Per-user uploaded files: add, get, resolve (link), list, update expiry, media, delete,
    sweep. `entries` None: a catalog-only library (no KV tiers, never adds files; the ingress)."""

    def __init__(
        self,
        objects: ObjectStore,
        entries: EntryStore | None,
        *,
        default_ttl_s: float = 86400,
        max_ttl_s: float = 30 * 86400,
        grace_s: float = 600,
        tombstone_ttl_s: float = 7 * 86400,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.objects, self.entries = objects, entries
        self.default_ttl_s, self.max_ttl_s = default_ttl_s, max_ttl_s
        self.grace_s, self.tombstone_ttl_s = grace_s, tombstone_ttl_s
        self.clock = clock

    @staticmethod
    def _user_dir(user: str) -> str:
        return "static/u/" + hashlib.sha256(user.encode()).hexdigest()[:32] + "/"

    def _record_key(self, user: str, file_id: str) -> str:
        return f"{self._user_dir(user)}{file_id}.json"

    def _holder(self, user: str, file_id: str) -> str:
        return f"static.{self._user_dir(user).split('/')[2]}.{file_id}"

    def add_file(
        self,
        user: str,
        *,
        name: str,
        media_type: str,
        media: bytes,
        entry: CacheEntry,
        ttl_s: float | None = None,
        purpose: Literal["vision", "user_data"] = "vision",
        entry_stored: bool = False,
    ) -> FileRecord:
        """Store media, entry and catalog record for `user` (record last); returns the record.

        entry_stored: the engine already wrote `entry` to this store (vLLM's connector does, in
        its own process): it is not written again, only checked to be there."""
        ttl = self.default_ttl_s if ttl_s is None else ttl_s
        if not 0 < ttl <= self.max_ttl_s:
            raise InvalidRequestError(f"ttl must be in (0, {self.max_ttl_s}] s", param="ttl")
        now = self.clock()
        rec = FileRecord(
            file_id="file-" + secrets.token_urlsafe(18),
            name=name,
            media_type=media_type,
            purpose=purpose,
            bytes=len(media),
            token_count=entry.num_tokens,
            content_hash=hashlib.sha256(media).hexdigest(),
            entry_key=entry.entry_id,
            created_at=now,
            expires_at=now + ttl,
        )
        if self.entries is None:
            raise RuntimeError("a catalog-only StaticLibrary (entries=None) cannot add files")
        self.objects.put(rec.media_key, media)
        if not entry_stored:
            self.entries.put(entry)
        elif self.entries.locate(entry.entry_id) is None:
            raise ObjectNotFoundError(entry_object_key(entry.entry_id))
        holder = self._holder(user, rec.file_id)
        refs.add_ref(self.objects, rec.media_key, holder)
        refs.add_ref(self.objects, entry_object_key(rec.entry_key), holder)
        self.objects.put_json(self._record_key(user, rec.file_id), rec.model_dump())
        return rec

    def _load(self, user: str, file_id: str) -> FileRecord:
        key = self._record_key(user, file_id) if _FILE_ID.match(file_id) else None
        try:
            if key is None:  # same answer as a well-formed id that does not exist
                raise ObjectNotFoundError(file_id)
            return FileRecord.model_validate(self.objects.get_json(key))
        except ObjectNotFoundError:
            raise NotFoundError(f"No such file: {file_id!r}", param="file_id") from None

    def get(self, user: str, file_id: str) -> FileRecord:
        """`user`'s live file; NotFoundError (never existed, or not theirs) or ExpiredError."""
        rec = self._load(user, file_id)
        if rec.status == "expired" or rec.expires_at <= self.clock():
            raise ExpiredError(f"File {file_id!r} has expired", param="file_id")
        return rec

    def resolve(self, user: str, file_ids: list[str]) -> list[FileRecord]:
        """Records for a query's file references (the linker's look-up), in order."""
        return [self.get(user, fid) for fid in file_ids]

    def list_files(self, user: str) -> list[FileRecord]:
        """`user`'s live files, oldest first."""
        now, out = self.clock(), []
        for key in self.objects.list(self._user_dir(user)):
            try:
                rec = FileRecord.model_validate(self.objects.get_json(key))
            except ObjectNotFoundError:
                continue
            if rec.status == "active" and rec.expires_at > now:
                out.append(rec)
        return sorted(out, key=lambda r: r.created_at)

    def update_expiry(self, user: str, file_id: str, expires_at: float) -> FileRecord:
        """Move a live file's expiry to `expires_at` (seconds since the epoch; Gemini's
        cachedContents update): it must lie in the future and at most `max_ttl_s` from now.
        NotFoundError / ExpiredError as `get` (an expired file cannot be revived: its blobs may
        already be swept)."""
        rec, now = self.get(user, file_id), self.clock()
        if not now < expires_at <= now + self.max_ttl_s:
            raise InvalidRequestError(
                f"the new expiry must lie in (now, now + {self.max_ttl_s:g} s]", param="ttl"
            )
        rec = rec.model_copy(update={"expires_at": expires_at})
        self.objects.put_json(self._record_key(user, file_id), rec.model_dump())
        return rec

    def is_lost(self, rec: FileRecord) -> bool:
        """True when neither the file's entry nor its media is in the object store (the data
        was lost: the KV cannot be loaded nor recomputed)."""
        if self.objects.exists(rec.media_key):
            return False
        if self.entries is not None:
            return self.entries.locate(rec.entry_key) is None
        return not self.objects.exists(entry_object_key(rec.entry_key))

    def media(self, user: str, file_id: str) -> bytes:
        """The original media bytes of `user`'s live file (to recompute its KV)."""
        return self.objects.get(self.get(user, file_id).media_key)

    def delete_file(self, user: str, file_id: str) -> None:
        """Delete `user`'s file (record first, then its references); NotFoundError otherwise."""
        rec = self._load(user, file_id)
        self.objects.delete(self._record_key(user, file_id))
        self._release(user, rec)

    def _release(self, user: str, rec: FileRecord) -> None:
        holder = self._holder(user, rec.file_id)
        refs.drop_ref(self.objects, rec.media_key, holder)
        refs.drop_ref(self.objects, entry_object_key(rec.entry_key), holder)

    def sweep(self, grace_s: float | None = None) -> SweepReport:
        """Expire files past their TTL (tombstone + release blobs), forget old tombstones, and
        delete blobs that no file or library version references any more and that are older
        than `grace_s` (None: the library's `grace_s`; 0 is honoured: everything unreferenced
        goes, uploads in flight included)."""
        grace = self.grace_s if grace_s is None else grace_s
        now, report = self.clock(), SweepReport()
        for key in list(self.objects.list("static/u/")):
            try:
                rec = FileRecord.model_validate(self.objects.get_json(key))
            except ObjectNotFoundError:
                continue
            user_hash = key.split("/")[2]
            holder = f"static.{user_hash}.{rec.file_id}"
            if rec.status == "active" and rec.expires_at <= now:
                tomb = rec.model_copy(update={"status": "expired"})
                self.objects.put_json(key, tomb.model_dump())
                for blob in (rec.media_key, entry_object_key(rec.entry_key)):
                    refs.drop_ref(self.objects, blob, holder)
                report.expired.append(rec.file_id)
            elif rec.status == "expired" and rec.expires_at + self.tombstone_ttl_s <= now:
                self.objects.delete(key)
                report.tombstones_removed += 1
        self._drop_orphan_refs(grace)
        report.blobs_deleted = refs.collect(self.objects, grace, self._delete_blob)
        return report

    def _drop_orphan_refs(self, grace_s: float) -> None:
        """Release markers of uploads that died before writing their record (older than grace;
        ages compare object mtimes with the wall clock, as `refs.collect` does)."""
        now = time.time()
        for key in list(self.objects.list(refs.REFS)):
            blob_key, _, holder = key[len(refs.REFS) :].rpartition("/")
            kind, _, rest = holder.partition(".")
            user_hash, _, file_id = rest.partition(".")
            if kind != "static" or self.objects.exists(f"static/u/{user_hash}/{file_id}.json"):
                continue
            try:
                if now - self.objects.stat(key).mtime >= grace_s:
                    refs.drop_ref(self.objects, blob_key, holder)
            except ObjectNotFoundError:
                continue

    def _delete_blob(self, blob_key: str) -> None:
        if blob_key.startswith(ENTRY_PREFIX) and self.entries is not None:
            self.entries.delete(blob_key[len(ENTRY_PREFIX) :])
        else:
            self.objects.delete(blob_key)
