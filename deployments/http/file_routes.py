"""The `/v1/files*` routes (Ingress replica): upload, list, retrieve, content, expiry update and
delete of the caller's files.

An upload hands the image bytes to the Encoder and chains the Encoder's result (an ObjectRef, never
materialised here) into the LLM worker, which caches the entry; a `.txt`/`.md` upload with purpose
`user_data` goes to the worker as a text document (no encoder). Everything else is answered from
the file catalog (`mpic.deployments.serve.files`), in the caller's namespace only.

They are methods of `FileRoutes`, a base class of the `Ingress` (Serve builds the routes of every
class in the ingress's MRO), on `router`, which the ingress's FastAPI app includes.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, Header, Query, UploadFile
from fastapi.responses import Response

from mpic.deployments.file_schemas import FileDeleted, FileExpiryUpdate, FileList, FileObject
from mpic.deployments.http.request_metrics import replica_metrics
from mpic.deployments.serve.files import check_image_upload, document_media_type
from mpic.errors import PayloadTooLargeError

router = APIRouter()


class FileRoutes:
    """The file routes; mixed into `Ingress` (uses its `cfg`, `_auth`, `readiness`, `files`,
    `encoder` and `worker`)."""

    @router.post("/v1/files")
    async def create_file(
        self,
        file: Annotated[UploadFile, File(description="The image.")],
        purpose: Annotated[Literal["vision", "user_data"], Form()],
        ttl_seconds: Annotated[int | None, Form(ge=1, le=10**10)] = None,
        expires_seconds: Annotated[
            int | None, Form(alias="expires_after[seconds]", ge=1, le=10**10)
        ] = None,
        expires_anchor: Annotated[
            Literal["created_at"] | None, Form(alias="expires_after[anchor]")
        ] = None,
        authorization: Annotated[str | None, Header()] = None,
    ) -> FileObject:
        """Upload an image (or, with purpose user_data, a .txt/.md text document): cache its KV,
        register it in the caller's namespace.
        The TTL is `ttl_seconds` or OpenAI's `expires_after` (anchor `created_at`)."""
        who = self._auth(authorization)
        await self.readiness.require()  # the worker computes the entry: 503 while it starts
        ttl_seconds = ttl_seconds or expires_seconds
        limit = self.cfg.limits.max_upload_bytes
        data = await file.read(limit + 1)
        if len(data) > limit:
            raise PayloadTooLargeError(f"upload over the {limit}-byte limit", param="file")
        name = file.filename or ""
        doc_type = document_media_type(name, file.content_type, purpose)
        if doc_type is not None:  # a .txt/.md file: cached as a text document, no encoder
            record = await self.worker.upload_document.remote(
                who.user, name, data, doc_type, ttl_seconds, purpose
            )
            replica_metrics().uploads.inc()
            return record
        check_image_upload(data, name, file.content_type, purpose)
        encoded = self.encoder.encode.remote(data)  # ObjectRef-backed; not materialised here
        record = await self.worker.upload.remote(who.user, name, encoded, ttl_seconds, purpose)
        replica_metrics().uploads.inc()
        return record

    @router.get("/v1/files")
    async def list_files(
        self,
        limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
        after: Annotated[str | None, Query()] = None,
        purpose: Annotated[Literal["vision", "user_data"] | None, Query()] = None,
        order: Annotated[Literal["asc", "desc"], Query()] = "desc",
        authorization: Annotated[str | None, Header()] = None,
    ) -> FileList:
        """The caller's files (never another user's), with expiry and status, paginated."""
        user = self._auth(authorization).user
        return await asyncio.to_thread(self.files.list, user, limit, after, purpose, order)

    @router.get("/v1/files/{file_id}")
    async def get_file(
        self, file_id: str, authorization: Annotated[str | None, Header()] = None
    ) -> FileObject:
        """One of the caller's files: 404 if unknown or another user's, 410 if expired;
        status "lost" when its entry and media are gone."""
        return self.files.get(self._auth(authorization).user, file_id)

    @router.get("/v1/files/{file_id}/content")
    async def file_content(
        self, file_id: str, authorization: Annotated[str | None, Header()] = None
    ) -> Response:
        """The uploaded bytes (404 / 410 as retrieve; 410 when the media is lost)."""
        data, media_type, _ = self.files.content(self._auth(authorization).user, file_id)
        return Response(data, media_type=media_type)

    @router.post("/v1/files/{file_id}")
    async def update_file(
        self,
        file_id: str,
        body: FileExpiryUpdate,
        authorization: Annotated[str | None, Header()] = None,
    ) -> FileObject:
        """Change a live file's expiry (Gemini cachedContents-style update): `ttl_seconds`
        from now, or `expires_after.seconds` after its creation."""
        user = self._auth(authorization).user
        if body.ttl_seconds is not None:
            expires_at = time.time() + body.ttl_seconds
        else:
            expires_at = self.files.get(user, file_id).created_at + body.expires_after.seconds
        return self.files.update_expiry(user, file_id, expires_at)

    @router.delete("/v1/files/{file_id}")
    async def delete_file(
        self, file_id: str, authorization: Annotated[str | None, Header()] = None
    ) -> FileDeleted:
        """Remove the file from the caller's namespace (the shared entry may stay cached)."""
        self.files.delete(self._auth(authorization).user, file_id)
        return FileDeleted(id=file_id)
