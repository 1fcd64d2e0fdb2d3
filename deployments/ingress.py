"""The HTTP ingress (Ingress Serve replica): FastAPI routes of the OpenAI-compatible API.

Only small things cross HTTP: image bytes on upload, text and ids on queries. The ingress hands
image bytes to the Encoder, chains the Encoder's result (an ObjectRef, never materialised here)
into the LLM worker, asks the Resolver to resolve a chat request, and streams the worker's tokens.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi import FastAPI, File, Form, Header, UploadFile
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from mpic.deployments.auth import KeyRing, Principal
from mpic.deployments.config import ServeAppConfig
from mpic.deployments.files import FileCatalog
from mpic.deployments.http_errors import install_error_handlers
from mpic.deployments.messages import DoneEvent, TokenEvent
from mpic.deployments.metrics import ServeMetrics
from mpic.deployments.schemas import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
    FileDeleted,
    FileList,
    FileObject,
    PromptTokensDetails,
    RefreshBody,
    RollbackBody,
    Usage,
)
from mpic.errors import PayloadTooLargeError

logger = logging.getLogger(__name__)

app = FastAPI(title="MPIC serve", version="0.1.0")
install_error_handlers(app)


# Helpers must be defined above the class: `serve.ingress` serializes the class when it is
# decorated, with the module globals that exist at that moment.
def _usage(done: DoneEvent) -> Usage:
    return Usage(
        prompt_tokens=done.prompt_tokens,
        completion_tokens=done.completion_tokens,
        total_tokens=done.prompt_tokens + done.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=done.cached_tokens),
    )


def _mpic_info(policy: str, done: DoneEvent, ttft: float, retrieved: list[str]) -> dict:
    return {
        "policy": policy,
        "ttft_s": ttft,
        "engine_ttft_s": done.ttft_s,
        "tier_hits": done.tier_hits,
        "fallbacks": done.fallbacks,
        "retrieved": retrieved,
    }


async def _prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    yield first
    async for item in rest:
        yield item


@serve.ingress(app)
class Ingress:
    """Routes `/v1/files*`, `/v1/chat/completions`, `/v1/admin/*`, `/healthz`, `/metrics`."""

    def __init__(
        self,
        config: ServeAppConfig,
        encoder: DeploymentHandle,
        resolver: DeploymentHandle,
        worker: DeploymentHandle,
        retriever: DeploymentHandle,
    ) -> None:
        self.cfg = config
        self.keys = KeyRing.from_config(config.auth)
        if not len(self.keys):
            logger.warning("no API keys configured: every request will get 401")
        self.files = FileCatalog(config.store)
        self.encoder, self.resolver = encoder, resolver
        self.worker, self.retriever = worker, retriever
        self.metrics = ServeMetrics()

    def _auth(self, authorization: str | None) -> Principal:
        return self.keys.authenticate(authorization)

    @app.get("/healthz")
    async def healthz(self) -> dict[str, str]:
        """Liveness: the ingress answers (no auth)."""
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(self) -> Response:
        """Prometheus exposition (no auth; scrape from inside the cluster)."""
        body = self.metrics.render(self.cfg.name)
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.post("/v1/files")
    async def create_file(
        self,
        file: Annotated[UploadFile, File(description="The image.")],
        purpose: Annotated[Literal["vision", "user_data"], Form()],
        ttl_seconds: Annotated[int | None, Form(ge=1)] = None,
        expires_seconds: Annotated[int | None, Form(alias="expires_after[seconds]", ge=1)] = None,
        expires_anchor: Annotated[
            Literal["created_at"] | None, Form(alias="expires_after[anchor]")
        ] = None,
        authorization: Annotated[str | None, Header()] = None,
    ) -> FileObject:
        """Upload an image: encode it, cache its KV, register it in the caller's namespace.
        The TTL is `ttl_seconds` or OpenAI's `expires_after` (anchor `created_at`)."""
        who = self._auth(authorization)
        ttl_seconds = ttl_seconds or expires_seconds
        limit = self.cfg.limits.max_upload_bytes
        data = await file.read(limit + 1)
        if len(data) > limit:
            raise PayloadTooLargeError(f"upload over the {limit}-byte limit", param="file")
        encoded = self.encoder.encode.remote(data)  # ObjectRef-backed; not materialised here
        name = file.filename or ""
        record = await self.worker.upload.remote(who.user, name, encoded, ttl_seconds, purpose)
        self.metrics.uploads.inc()
        return record

    @app.get("/v1/files")
    async def list_files(self, authorization: Annotated[str | None, Header()] = None) -> FileList:
        """The caller's files (never another user's)."""
        return FileList(data=self.files.list(self._auth(authorization).user))

    @app.get("/v1/files/{file_id}")
    async def get_file(
        self, file_id: str, authorization: Annotated[str | None, Header()] = None
    ) -> FileObject:
        """One of the caller's files: 404 if unknown or another user's, 410 if expired."""
        return self.files.get(self._auth(authorization).user, file_id)

    @app.delete("/v1/files/{file_id}")
    async def delete_file(
        self, file_id: str, authorization: Annotated[str | None, Header()] = None
    ) -> FileDeleted:
        """Remove the file from the caller's namespace (the shared entry may stay cached)."""
        self.files.delete(self._auth(authorization).user, file_id)
        return FileDeleted(id=file_id)

    @app.post("/v1/chat/completions")
    async def chat(
        self, body: ChatCompletionRequest, authorization: Annotated[str | None, Header()] = None
    ) -> Response:
        """OpenAI chat completion with cached-file links; SSE when `stream` is true."""
        who = self._auth(authorization)
        t0 = time.perf_counter()
        prompt = await self.resolver.resolve.remote(who.user, body)
        events = self.worker.options(stream=True).generate.remote(prompt)
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        if body.stream:
            gen = self._sse(events, body, rid, created, prompt.policy, t0)
            first = await anext(gen)  # surface errors before the 200 status is sent
            return StreamingResponse(_prepend(first, gen), media_type="text/event-stream")
        text, done, ttft, t_first = [], None, 0.0, 0.0
        async for ev in events:
            if isinstance(ev, TokenEvent):
                if not text:
                    t_first = time.perf_counter()
                    ttft = t_first - t0
                text.append(ev.text)
            else:
                done = ev
        assert done is not None, "the worker always ends with a DoneEvent"
        self.metrics.record(prompt.policy, done, ttft, time.perf_counter() - t_first)
        out = ChatCompletion(
            id=rid,
            created=created,
            model=body.model,
            usage=_usage(done),
            choices=[
                Choice(
                    message=AssistantMessage(content="".join(text)),
                    finish_reason=done.finish_reason,
                )
            ],
            mpic=_mpic_info(prompt.policy, done, ttft, prompt.retrieved),
        )
        return Response(out.model_dump_json(), media_type="application/json")

    async def _sse(self, events, body, rid, created, policy, t0) -> AsyncIterator[str]:
        def chunk(delta: Delta, finish=None, usage=None) -> str:
            c = ChatCompletionChunk(
                id=rid,
                created=created,
                model=body.model,
                usage=usage,
                choices=[ChunkChoice(delta=delta, finish_reason=finish)] if delta else [],
            )
            return f"data: {c.model_dump_json(exclude_none=True)}\n\n"

        started, ttft, t_first = False, 0.0, 0.0
        async for ev in events:
            if isinstance(ev, TokenEvent):
                if not started:
                    t_first = time.perf_counter()
                    ttft, started = t_first - t0, True
                    yield chunk(Delta(role="assistant", content=ev.text))
                else:
                    yield chunk(Delta(content=ev.text))
                continue
            self.metrics.record(policy, ev, ttft, time.perf_counter() - t_first)
            yield chunk(Delta(), finish=ev.finish_reason)
            if body.stream_options and body.stream_options.include_usage:
                yield chunk(None, usage=_usage(ev))
        yield "data: [DONE]\n\n"

    @app.get("/v1/admin/collections")
    async def admin_collections(self, authorization: Annotated[str | None, Header()] = None):
        """Admin: dynamic-library collections and their current versions."""
        KeyRing.require_admin(self._auth(authorization))
        return await self.retriever.collections.remote()

    @app.get("/v1/admin/collections/{name}/versions")
    async def admin_versions(
        self, name: str, authorization: Annotated[str | None, Header()] = None
    ):
        """Admin: the versions of one collection, newest last."""
        KeyRing.require_admin(self._auth(authorization))
        return await self.retriever.versions.remote(name)

    @app.post("/v1/admin/collections/{name}/refresh")
    async def admin_refresh(
        self,
        name: str,
        body: RefreshBody,
        authorization: Annotated[str | None, Header()] = None,
    ):
        """Admin: build a new version from a source folder/prefix and swap it in atomically."""
        KeyRing.require_admin(self._auth(authorization))
        return await self.retriever.refresh.remote(name, body.source, body.captions)

    @app.post("/v1/admin/collections/{name}/rollback")
    async def admin_rollback(
        self,
        name: str,
        body: RollbackBody,
        authorization: Annotated[str | None, Header()] = None,
    ):
        """Admin: make an earlier version current again."""
        KeyRing.require_admin(self._auth(authorization))
        return await self.retriever.rollback.remote(name, body.version)
