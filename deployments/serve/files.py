"""The uploaded-file catalog as the HTTP layer sees it (Ingress, Resolver and LLM-worker replicas).

A thin view over `mpic.storage.static_library.StaticLibrary` (per-user namespaces, TTL,
NotFoundError for unknown or foreign ids, ExpiredError after the TTL) that speaks OpenAI file
objects: list pagination (`limit`, `after`, `purpose`, `order`), the media bytes
(`/v1/files/{id}/content`), expiry updates, and the "lost" state of a file whose entry and media
are both gone from the store (410 on use, `status: "lost"` in list/retrieve, never a 500).
Every replica opens its own view over the shared object store, so file records written by the
worker on one node are visible to the ingress and linker on any other.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Literal

from mpic.deployments.file_schemas import FileList, FileObject
from mpic.documents import document_suffix_type
from mpic.errors import ExpiredError, InvalidRequestError, NotFoundError, UnreadableMediaError
from mpic.storage.config import StorageConfig
from mpic.storage.factory import make_object_store
from mpic.storage.object_store import ObjectNotFoundError, StoreUnavailableError
from mpic.storage.static_library import FileRecord, StaticLibrary, SweepReport

if TYPE_CHECKING:
    from mpic.storage.entry_store import EntryStore

logger = logging.getLogger(__name__)

LOST_MESSAGE = (
    "the cached data and the media of file {id!r} are lost from the store; upload the image "
    "again (a new file id)"
)


class FileLostError(ExpiredError):
    """A file whose entry and media are both gone (HTTP 410, code `file_lost`)."""

    code = "file_lost"


def open_library(cfg: StorageConfig, entries: EntryStore | None = None) -> StaticLibrary:
    """A StaticLibrary over the configured store; catalog-only replicas pass no EntryStore
    (they never write entries, so no memory tier is kept for them)."""
    return StaticLibrary(
        entries.objects if entries is not None else make_object_store(cfg),
        entries,
        default_ttl_s=cfg.file_ttl_s,
        max_ttl_s=cfg.max_file_ttl_s,
        grace_s=cfg.sweep_grace_s,
        tombstone_ttl_s=cfg.tombstone_ttl_s,
    )


def file_object(rec: FileRecord, lost: bool = False) -> FileObject:
    """OpenAI file object of a catalog record."""
    status = "lost" if lost else "processed" if rec.status == "active" else "expired"
    return FileObject(
        id=rec.file_id,
        bytes=rec.bytes,
        created_at=int(rec.created_at),
        expires_at=int(rec.expires_at),
        filename=rec.name,
        purpose=rec.purpose,
        tokens=rec.token_count,
        status=status,
        status_details=LOST_MESSAGE.format(id=rec.file_id) if lost else None,
    )


def document_media_type(name: str, content_type: str | None, purpose: str) -> str | None:
    """The MIME type of an upload that is a text document (a .txt/.md file, or a `text/plain` /
    `text/markdown` part, with purpose `user_data`), else None (it is an image)."""
    if purpose != "user_data":
        return None
    by_suffix = document_suffix_type(name)
    if by_suffix is not None:
        return by_suffix
    base = (content_type or "").split(";")[0].strip().lower()
    return base if base in ("text/plain", "text/markdown") else None


def check_image_upload(data: bytes, name: str, content_type: str | None, purpose: str) -> None:
    """UnreadableMediaError (415) naming what `purpose` takes when an upload that is not a text
    document (`document_media_type` None) has no image header PIL knows (read lazily: the
    header only; the encoder decodes it)."""
    from PIL import Image, UnidentifiedImageError

    if not data:  # the encoder says so ("empty upload")
        return
    try:
        Image.open(io.BytesIO(data))
        return
    except Image.DecompressionBombError:
        return  # an image header, declaring too many pixels: the encoder's 413 says so
    except (UnidentifiedImageError, OSError, ValueError):
        pass
    what = f"{name or 'the upload'} ({content_type or 'no content type'})"
    if purpose == "user_data":
        message = (
            f"{what} is neither a text document (.txt or .md, text/plain or text/markdown, "
            "UTF-8) nor an image: purpose user_data takes those"
        )
    else:
        message = f"{what} is not an image; a text document is uploaded with purpose user_data"
    raise UnreadableMediaError(message, param="file")


def is_document(media_type: str) -> bool:
    """True for a file record of a text document."""
    return media_type.startswith("text/")


class FileCatalog:
    """get / list / content / update / delete / resolve in the caller's namespace.

    Every read goes to the object store (so a file deleted through another replica is gone
    here too), and every record read is remembered (`RecordCache`). While the store is
    unreachable, look-ups, lists and chat resolution answer from what this replica last read
    (still per user, still expiring on time), so chats linking files whose entries sit in the
    LLM worker's memory or disk tier keep working; only what must reach the store (media bytes,
    uploads, expiry changes, deletes, a file this replica never saw) answers 503."""

    def __init__(self, cfg: StorageConfig) -> None:
        self.library = open_library(cfg)
        self.seen = RecordCache()

    def _record(self, user: str, file_id: str) -> FileRecord:
        """`library.get`, remembered; from the cache while the store is unreachable."""
        try:
            rec = self.library.get(user, file_id)
        except StoreUnavailableError:
            rec = self.seen.get(user, file_id)
            if rec is None:
                raise
            if rec.expires_at <= time.time():
                raise ExpiredError(f"File {file_id!r} has expired", param="file_id") from None
            logger.info("store unreachable: file %s resolved from this replica's cache", file_id)
            return rec
        except NotFoundError:
            self.seen.forget(user, file_id)
            raise
        self.seen.put(user, rec)
        return rec

    def _is_lost(self, rec: FileRecord) -> bool:
        try:
            return self.library.is_lost(rec)
        except StoreUnavailableError:  # cannot tell now: the worker's tiers may hold it
            return False

    def get(self, user: str, file_id: str) -> FileObject:
        """404 unknown or foreign, 410 expired; a lost file is returned with status "lost"."""
        rec = self._record(user, file_id)
        return file_object(rec, self._is_lost(rec))

    def list(
        self,
        user: str,
        limit: int = 10000,
        after: str | None = None,
        purpose: str | None = None,
        order: Literal["asc", "desc"] = "desc",
    ) -> FileList:
        """The caller's live files (OpenAI pagination: `after` is the last id of the previous
        page, in the same `order` by creation time, newest first by default as OpenAI's); 400
        for an `after` not in the list. While the store is unreachable: the caller's files this
        replica last listed or read."""
        try:
            recs = self.library.list_files(user)
            self.seen.replace_user(user, recs)
        except StoreUnavailableError:
            recs = self.seen.live(user, time.time())
            if recs is None:
                raise
        if order == "desc":
            recs.reverse()
        if purpose is not None:
            recs = [r for r in recs if r.purpose == purpose]
        if after is not None:
            ids = [r.file_id for r in recs]
            if after not in ids:
                raise InvalidRequestError(f"after: no such file {after!r}", param="after")
            recs = recs[ids.index(after) + 1 :]
        page = [file_object(r, self._is_lost(r)) for r in recs[:limit]]
        return FileList(
            data=page,
            has_more=len(recs) > limit,
            first_id=page[0].id if page else None,
            last_id=page[-1].id if page else None,
        )

    def content(self, user: str, file_id: str) -> tuple[bytes, str, str]:
        """(media bytes, MIME type, file name) of a live file; 410 when the media is lost."""
        rec = self._record(user, file_id)
        try:
            return self.library.objects.get(rec.media_key), rec.media_type, rec.name
        except ObjectNotFoundError:
            raise FileLostError(
                f"the media of file {file_id!r} is lost from the store", param="file_id"
            ) from None

    def update_expiry(self, user: str, file_id: str, expires_at: float) -> FileObject:
        """Move a live file's expiry (400 outside (now, now + max TTL], 404, 410)."""
        rec = self.library.update_expiry(user, file_id, expires_at)
        self.seen.put(user, rec)
        return file_object(rec)

    def delete(self, user: str, file_id: str) -> None:
        """404 unknown or foreign."""
        self.library.delete_file(user, file_id)
        self.seen.forget(user, file_id)

    def resolve(self, user: str, file_id: str) -> tuple[str, str]:
        """(entry id, media sha256) a chat request links for `file_id` (404 / 410 as `get`;
        410 `file_lost` when its entry and media are both gone)."""
        entry_id, sha, _ = self.resolve_item(user, file_id)
        return entry_id, sha

    def resolve_item(self, user: str, file_id: str) -> tuple[str, str, bool]:
        """`resolve` plus whether the file is a text document (linked as a `DocumentRef`)."""
        rec = self._record(user, file_id)
        if self._is_lost(rec):
            raise FileLostError(LOST_MESSAGE.format(id=file_id), param="file_id")
        return rec.entry_key, rec.content_hash, is_document(rec.media_type)


class RecordCache:
    """The catalog records one replica last read, per user (bounded: least recently used
    users' records go first). Only consulted while the object store is unreachable."""

    def __init__(self, max_records: int = 100_000) -> None:
        self.max_records = max_records
        self._users: OrderedDict[str, dict[str, FileRecord]] = OrderedDict()
        self._listed: set[str] = set()
        self._count = 0
        self._lock = threading.Lock()

    def put(self, user: str, rec: FileRecord) -> None:
        with self._lock:
            recs = self._users.setdefault(user, {})
            self._count += rec.file_id not in recs
            recs[rec.file_id] = rec
            self._users.move_to_end(user)
            self._trim()

    def replace_user(self, user: str, recs: list[FileRecord]) -> None:
        """A fresh full list of `user`'s live files."""
        with self._lock:
            self._count -= len(self._users.pop(user, {}))
            self._users[user] = {r.file_id: r for r in recs}
            self._count += len(recs)
            self._listed.add(user)
            self._trim()

    def forget(self, user: str, file_id: str) -> None:
        with self._lock:
            recs = self._users.get(user, {})
            self._count -= recs.pop(file_id, None) is not None

    def get(self, user: str, file_id: str) -> FileRecord | None:
        with self._lock:
            return self._users.get(user, {}).get(file_id)

    def live(self, user: str, now: float) -> list[FileRecord] | None:
        """`user`'s live remembered files, oldest first; None unless this replica ever listed
        that user's files (a partial list would look complete)."""
        with self._lock:
            if user not in self._listed:
                return None
            recs = [r for r in self._users.get(user, {}).values() if r.expires_at > now]
        return sorted((r for r in recs if r.status == "active"), key=lambda r: r.created_at)

    def _trim(self) -> None:
        while self._count > self.max_records and len(self._users) > 1:
            user, dropped = self._users.popitem(last=False)
            self._listed.discard(user)
            self._count -= len(dropped)


class Sweeper:
    """Runs `StaticLibrary.sweep` every `interval_s` on a daemon thread (LLM-worker replicas,
    whose library reaches every tier: its memory tier, the node's disk tier and the object
    store), and on demand (`sweep_now`). Sweeps never overlap within a replica; sweeps of two
    replicas may (both only delete what no live record references)."""

    def __init__(self, library: StaticLibrary, interval_s: float) -> None:
        self.library, self.interval_s = library, interval_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.last: SweepReport | None = None
        if interval_s > 0:
            threading.Thread(target=self._loop, name="mpic-sweeper", daemon=True).start()

    def sweep_now(self, grace_s: float | None = None) -> SweepReport:
        """One sweep (`grace_s`: this sweep's grace, None: the configured one); logs what it
        removed."""
        with self._lock:
            report = self.library.sweep(grace_s)
        if report.expired or report.blobs_deleted or report.tombstones_removed:
            logger.info(
                "sweep: %d file(s) expired, %d blob(s) deleted, %d tombstone(s) removed",
                len(report.expired),
                len(report.blobs_deleted),
                report.tombstones_removed,
            )
        self.last = report
        return report

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sweep_now()
            except Exception:  # noqa: BLE001 - the next round retries; never kill the replica
                logger.exception("sweep failed")

    def stop(self) -> None:
        """End the background loop."""
        self._stop.set()
