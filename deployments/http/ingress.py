"""The HTTP ingress (Ingress Serve replica): FastAPI routes of the OpenAI-compatible API.

Only small things cross HTTP: image bytes on upload, text and ids on queries. The ingress hands
image bytes to the Encoder, chains the Encoder's result (an ObjectRef, never materialised here)
into the LLM worker, asks the Resolver to resolve a chat request (then the Encoder for its inline
images: `mpic.deployments.serve.inline`), and streams the worker's tokens.

Every request carries a request id (Serve's, taken from an `X-Request-ID` header when the client
sends one): it is in every log line of every deployment that handles the request (Serve's JSON
logs), in the `LinkedPrompt` the engine receives, and in the `x-request-id` response header.
Every request is counted by route template and outcome (`mpic.deployments.monitoring.metrics`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi import FastAPI, File, Form, Header, Query, Request, UploadFile
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from mpic.deployments.client_errors import raising
from mpic.deployments.config import ServeAppConfig
from mpic.deployments.http.auth import KeyRing, Principal
from mpic.deployments.http.chat_limits import check_chat_shape
from mpic.deployments.http.http_errors import (
    ModelNotFoundError,
    error_body,
    install_error_handlers,
    status_of,
)
from mpic.deployments.http.openapi_errors import install_openapi_errors
from mpic.deployments.http.readiness import AppReadiness, NotReadyError, replica_probe
from mpic.deployments.http.request_guard import RequestGuard, configure_guard
from mpic.deployments.http.shedding import SheddingGuard, configure_shedding
from mpic.deployments.http.vllm_routes import VllmRoutes, router
from mpic.deployments.messages import DoneEvent, LinkedPrompt, TokenEvent, TokenLogprob
from mpic.deployments.monitoring.metrics import ServeMetrics, metrics_page
from mpic.deployments.monitoring.replica_logs import use_serve_logging
from mpic.deployments.schemas import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    ErrorBody,
    FileDeleted,
    FileExpiryUpdate,
    FileList,
    FileObject,
    LogprobContent,
    Model,
    ModelList,
    PromptTokensDetails,
    RefreshBody,
    RollbackBody,
    SweepBody,
    TopLogprob,
    Usage,
)
from mpic.deployments.serve.files import FileCatalog, document_media_type
from mpic.deployments.serve.inline import encode_inline
from mpic.errors import PayloadTooLargeError
from mpic.retriever.sources import allowed_source

logger = logging.getLogger(__name__)

app = FastAPI(title="MPIC serve", version="0.1.0")
install_error_handlers(app)
app.add_middleware(SheddingGuard)  # inside the guard: TTFT admission of authorised requests
app.add_middleware(RequestGuard)  # auth + body limits from the headers, before any body read
install_openapi_errors(app, ErrorBody)  # the real error answers, no 422
app.include_router(router)  # vLLM's other routes: /v1/completions, /tokenize, ... (VllmRoutes)

_METRICS: list[ServeMetrics] = []

MODEL_INFO_WAIT_S = 1.0
"""The longest a request waits for the LLM worker's first answer of its context length."""


# Helpers must be defined above the class: `serve.ingress` serializes the class when it is
# decorated, with the module globals that exist at that moment.
def _metrics() -> ServeMetrics:
    """This process's metrics object (created in the replica, never pickled)."""
    if not _METRICS:
        _METRICS.append(ServeMetrics())
    return _METRICS[0]


def _serve_request_id() -> str:
    """Serve's request id of the current request ("" outside a Serve replica)."""
    try:
        return serve.context._get_serve_request_context().request_id
    except Exception:  # noqa: BLE001 - outside a Serve replica (in-process tests)
        return ""


@app.middleware("http")
async def _count(request: Request, call_next):
    """Count every request by route template and outcome. The request id is Serve's (its proxy
    takes `X-Request-ID` when sent and echoes it); outside Serve this middleware does both."""
    rid = _serve_request_id()
    served = bool(rid)
    rid = rid or request.headers.get("x-request-id") or uuid.uuid4().hex
    request.state.request_id = rid
    generation = request.method == "POST" and request.url.path.endswith(GENERATION_PATHS)
    if generation:  # in flight until its body is sent (vllm:num_requests_waiting)
        _metrics().vllm.start()
    try:
        response = await call_next(request)
    except Exception:
        _metrics().request(_route(request), "500")
        if generation:
            _metrics().vllm.end()
        raise
    if generation:
        response.body_iterator = _ended(response.body_iterator, _metrics().vllm.end)
    outcome = "ok" if response.status_code < 400 else str(response.status_code)
    _metrics().request(_route(request), outcome)
    if not served:
        response.headers["x-request-id"] = rid
    return response


GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")


def _seen(task: asyncio.Task) -> None:
    """Mark a background task's outcome as retrieved (no "never retrieved" log line)."""
    if not task.cancelled():
        task.exception()


async def _ended(body, end) -> AsyncIterator:
    """`body` (a response's chunks), calling `end()` once it is sent or abandoned."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        end()


def _route(request: Request) -> str:
    route = request.scope.get("route")
    return getattr(route, "path", "unmatched")


def _usage(done: DoneEvent, completion_tokens: int | None = None) -> Usage:
    out = done.completion_tokens if completion_tokens is None else completion_tokens
    return Usage(
        prompt_tokens=done.prompt_tokens,
        completion_tokens=out,
        total_tokens=done.prompt_tokens + out,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=done.cached_tokens),
    )


def _mpic_info(prompt: LinkedPrompt, done: DoneEvent, ttft: float) -> dict:
    return {
        "policy": done.policy or prompt.policy,
        "request_id": prompt.request_id,
        "ttft_s": ttft,
        "engine_ttft_s": done.ttft_s,
        "tier_hits": done.tier_hits,
        "fallbacks": done.fallbacks,
        "retrieved": prompt.retrieved,
    }


def _logprobs(items: list[TokenLogprob]) -> ChoiceLogprobs:
    """OpenAI logprobs; `bytes` are the token's own bytes when the engine gives them (a byte
    token of a multi-byte character: that byte), else the UTF-8 of its text."""

    def top(token: str, lp: float, raw: bytes | None) -> TopLogprob:
        return TopLogprob(
            token=token, logprob=lp, bytes=list(token.encode() if raw is None else raw)
        )

    return ChoiceLogprobs(
        content=[
            LogprobContent(
                token=t.token,
                logprob=t.logprob,
                bytes=list(t.token.encode() if t.raw is None else t.raw),
                top_logprobs=[
                    top(tok, lp, t.top_raw[k] if t.top_raw else None)
                    for k, (tok, lp) in enumerate(t.top)
                ],
            )
            for t in items
        ]
    )


async def _prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    yield first
    async for item in rest:
        yield item


class _Answer:
    """One choice collected from the worker's events."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.done: DoneEvent | None = None
        self.t_first = self.t_last = 0.0

    async def collect(self, events) -> _Answer:
        async for ev in events:
            if isinstance(ev, TokenEvent):
                self.t_last = time.perf_counter()
                self.t_first = self.t_first or self.t_last
                self.text.append(ev.text)
                self.logprobs.extend(ev.logprobs or [])
            else:
                self.done = ev
        assert self.done is not None, "the worker always ends with a DoneEvent"
        return self


@serve.ingress(app)
class Ingress(VllmRoutes):
    """Routes `/v1/models*`, `/v1/files*`, `/v1/chat/completions`, `/v1/admin/*`, `/healthz`,
    `/metrics`."""

    def __init__(
        self,
        config: ServeAppConfig,
        encoder: DeploymentHandle,
        resolver: DeploymentHandle,
        worker: DeploymentHandle,
        retriever: DeploymentHandle,
    ) -> None:
        use_serve_logging()  # this module's lines in Serve's replica log, with request ids
        self.cfg = config
        self.keys = KeyRing.from_config(config.auth)
        configure_guard(self.keys, config.limits)
        configure_shedding(config.limits)
        if not len(self.keys):
            logger.warning("no API keys configured: every request will get 401")
        self.files = FileCatalog(config.store)
        # a replica's client error (a value, `mpic.deployments.client_errors`) raises here
        self.encoder, self.resolver = raising(encoder), raising(resolver)
        self.worker, self.retriever = raising(worker), raising(retriever)
        self.started = int(time.time())
        self.max_model_len: int | None = None  # asked of the LLM worker once it can serve
        self._length_task: asyncio.Task | None = None
        _metrics().model_name = config.engine.served_names[0]
        # the context length is asked of the LLM worker as soon as the app is ready
        self.readiness = AppReadiness(replica_probe(), on_ready=self._length_pending)

    def _auth(self, authorization: str | None) -> Principal:
        return self.keys.authenticate(authorization)

    @app.get("/healthz")
    async def healthz(self) -> dict[str, str]:
        """Liveness: the ingress answers (no auth)."""
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(self) -> dict[str, str]:
        """Readiness (no auth): 200 once every deployment can serve (engines loaded), else 503
        `not_ready` with Retry-After (`mpic.deployments.http.readiness`; the k8s readiness
        probe)."""
        await self.readiness.require()
        return {"status": "ready"}

    @app.get("/metrics")
    async def metrics(self) -> Response:
        """Prometheus text of the `mpic_*` (and vLLM) series of every replica on every node,
        gathered from Ray's metrics agents (no auth; scrape from inside the cluster)."""
        body = await asyncio.to_thread(metrics_page, self.cfg.engine.served_names[0])
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def list_models(self, authorization: Annotated[str | None, Header()] = None) -> ModelList:
        """The served model (one per deployment); 503 `not_ready` until a chat would be served
        (vLLM answers only once it can serve: scripts poll this route before they chat)."""
        self._auth(authorization)
        length = await self._model_info()
        return ModelList(data=[self._model(n, length) for n in self.cfg.engine.served_names])

    @app.get("/v1/models/{model_id:path}")
    async def get_model(
        self, model_id: str, authorization: Annotated[str | None, Header()] = None
    ) -> Model:
        """The served model, or 404 `model_not_found` (503 `not_ready` as `/v1/models`)."""
        self._auth(authorization)
        self._check_model(model_id)
        return self._model(model_id, await self._model_info())

    def _model(self, name: str, max_model_len: int | None) -> Model:
        return Model(
            id=name, created=self.started, root=self.cfg.engine.model, max_model_len=max_model_len
        )

    async def _model_info(self) -> int:
        """The served context length (`max_model_len`) once the application is ready (503
        `not_ready` before: a starting worker would hold the call until its engine is loaded).
        It is asked of the LLM worker once, in a task of its own: a request waits for the answer
        at most `MODEL_INFO_WAIT_S`, then gets 503 `not_ready` while it is on its way."""
        await self.readiness.require()
        if self.max_model_len is not None:
            return self.max_model_len
        try:
            return await asyncio.wait_for(asyncio.shield(self._length_pending()), MODEL_INFO_WAIT_S)
        except TimeoutError:
            raise NotReadyError(
                "the service is starting (the LLM worker has not told its context length "
                "yet); retry shortly",
                retry_after=1,
            ) from None

    def _length_pending(self) -> asyncio.Task:
        """The task asking the LLM worker its context length (a new one if none ran or the
        last failed); readiness starts it as soon as the app is ready."""
        task = self._length_task
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = self._length_task = asyncio.ensure_future(self._ask_context_length())
            task.add_done_callback(_seen)  # a failure nobody awaited: asked again next time
        return task

    async def _ask_context_length(self) -> int:
        self.max_model_len = await self.worker.context_length.remote()
        return self.max_model_len

    def _record(self, policy: str, done: DoneEvent, ttft_s: float, decode_s: float) -> None:
        """Record one finished generation (the `mpic_*` and the vLLM-named series)."""
        _metrics().record(policy, done, ttft_s, decode_s)

    def _check_model(self, name: str) -> None:
        names = self.cfg.engine.served_names
        if name not in names:
            served = names[0] if len(names) == 1 else names
            raise ModelNotFoundError(
                f"The model {name!r} does not exist; this deployment serves {served!r} "
                "(GET /v1/models)",
                param="model",
            )

    @app.post("/v1/files")
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
            _metrics().uploads.inc()
            return record
        encoded = self.encoder.encode.remote(data)  # ObjectRef-backed; not materialised here
        record = await self.worker.upload.remote(who.user, name, encoded, ttl_seconds, purpose)
        _metrics().uploads.inc()
        return record

    @app.get("/v1/files")
    async def list_files(
        self,
        limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
        after: Annotated[str | None, Query()] = None,
        purpose: Annotated[Literal["vision", "user_data"] | None, Query()] = None,
        order: Annotated[Literal["asc", "desc"], Query()] = "asc",
        authorization: Annotated[str | None, Header()] = None,
    ) -> FileList:
        """The caller's files (never another user's), with expiry and status, paginated."""
        user = self._auth(authorization).user
        return await asyncio.to_thread(self.files.list, user, limit, after, purpose, order)

    @app.get("/v1/files/{file_id}")
    async def get_file(
        self, file_id: str, authorization: Annotated[str | None, Header()] = None
    ) -> FileObject:
        """One of the caller's files: 404 if unknown or another user's, 410 if expired;
        status "lost" when its entry and media are gone."""
        return self.files.get(self._auth(authorization).user, file_id)

    @app.get("/v1/files/{file_id}/content")
    async def file_content(
        self, file_id: str, authorization: Annotated[str | None, Header()] = None
    ) -> Response:
        """The uploaded bytes (404 / 410 as retrieve; 410 when the media is lost)."""
        data, media_type, _ = self.files.content(self._auth(authorization).user, file_id)
        return Response(data, media_type=media_type)

    @app.post("/v1/files/{file_id}")
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

    @app.delete("/v1/files/{file_id}")
    async def delete_file(
        self, file_id: str, authorization: Annotated[str | None, Header()] = None
    ) -> FileDeleted:
        """Remove the file from the caller's namespace (the shared entry may stay cached)."""
        self.files.delete(self._auth(authorization).user, file_id)
        return FileDeleted(id=file_id)

    @app.post("/v1/chat/completions")
    async def chat(
        self,
        request: Request,
        body: ChatCompletionRequest,
        authorization: Annotated[str | None, Header()] = None,
    ) -> Response:
        """OpenAI chat completion with cached-file links; SSE when `stream` is true."""
        who = self._auth(authorization)
        self._check_model(body.model)
        check_chat_shape(body, self.cfg.limits)
        await self.readiness.require()  # a fast 503 while the worker is still starting
        t0 = time.perf_counter()
        rid = request.state.request_id
        logger.info(
            "chat request %s user=%s end_user=%s",
            rid,
            who.user,
            body.user or "-",
            extra={"request_id": rid},
        )
        prompt: LinkedPrompt = await self.resolver.resolve.remote(who.user, body)
        await encode_inline(prompt, self.encoder)  # refs this replica owns while it answers
        prompt.request_id, prompt.sampling = rid, body.sampling()
        cid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        if body.stream:
            events = self.worker.options(stream=True).generate.remote(prompt)
            gen = self._sse(events, body, cid, created, prompt, t0)
            first = await anext(gen)  # surface errors before the 200 status is sent
            self.readiness.served()  # newer than any readiness poll that began before it
            return StreamingResponse(_prepend(first, gen), media_type="text/event-stream")
        answers = await asyncio.gather(
            *(_Answer().collect(self._generate(prompt, i)) for i in range(body.n))
        )
        self.readiness.served()
        done = answers[0].done
        ttft = answers[0].t_first - t0
        for a in answers:
            _metrics().record(
                a.done.policy or prompt.policy, a.done, a.t_first - t0, a.t_last - a.t_first
            )
        out = ChatCompletion(
            id=cid,
            created=created,
            model=body.model,
            usage=_usage(done, sum(a.done.completion_tokens for a in answers)),
            choices=[
                Choice(
                    index=i,
                    message=AssistantMessage(content="".join(a.text)),
                    finish_reason=a.done.finish_reason,
                    logprobs=_logprobs(a.logprobs) if body.logprobs else None,
                )
                for i, a in enumerate(answers)
            ],
            mpic=_mpic_info(prompt, done, ttft),
        )
        return Response(out.model_dump_json(), media_type="application/json")

    def _generate(self, prompt: LinkedPrompt, index: int):
        """The worker's event stream of choice `index` (choice i samples with seed + i)."""
        if index and prompt.sampling.seed is not None:
            sampling = type(prompt.sampling)(**vars(prompt.sampling))
            sampling.seed = prompt.sampling.seed + index
            prompt = type(prompt)(**{**vars(prompt), "sampling": sampling})
        return self.worker.options(stream=True).generate.remote(prompt)

    async def _sse(self, events, body, cid, created, prompt, t0) -> AsyncIterator[str]:
        def chunk(delta: Delta | None, finish=None, usage=None, logprobs=None) -> str:
            choices = (
                [ChunkChoice(delta=delta, finish_reason=finish, logprobs=logprobs)] if delta else []
            )
            c = ChatCompletionChunk(
                id=cid, created=created, model=body.model, usage=usage, choices=choices
            )
            return f"data: {c.model_dump_json(exclude_none=True)}\n\n"

        started, t_first = False, 0.0
        try:
            async for ev in events:
                if isinstance(ev, TokenEvent):
                    lps = _logprobs(ev.logprobs) if body.logprobs and ev.logprobs else None
                    if not started:
                        t_first, started = time.perf_counter(), True
                        yield chunk(Delta(role="assistant", content=ev.text), logprobs=lps)
                    else:
                        yield chunk(Delta(content=ev.text), logprobs=lps)
                    continue
                t_first = t_first or time.perf_counter()
                policy = ev.policy or prompt.policy
                _metrics().record(policy, ev, t_first - t0, time.perf_counter() - t_first)
                yield chunk(Delta(), finish=ev.finish_reason)
                if body.stream_options and body.stream_options.include_usage:
                    yield chunk(None, usage=_usage(ev))
        except Exception as exc:  # noqa: BLE001 - after the 200: an SSE error event, then close
            if not started:
                raise
            status = status_of(exc)
            if status >= 500:
                logger.exception("stream %s failed", prompt.request_id)
            else:
                logger.warning("stream %s ended by an error: %s", prompt.request_id, exc)
            _metrics().request("/v1/chat/completions", "stream_error")
            yield f"data: {error_body(exc).model_dump_json()}\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/v1/admin/sweep")
    async def admin_sweep(
        self,
        body: SweepBody | None = None,
        authorization: Annotated[str | None, Header()] = None,
    ):
        """Admin: run the file sweeper now (expire, release, delete unreferenced blobs older
        than `grace_s`, default the server's)."""
        KeyRing.require_admin(self._auth(authorization))
        await self.readiness.require()  # the worker / retriever may still be starting
        return await self.worker.sweep.remote(body.grace_s if body else None)

    @app.get("/v1/admin/collections")
    async def admin_collections(self, authorization: Annotated[str | None, Header()] = None):
        """Admin: dynamic-library collections and their current versions."""
        KeyRing.require_admin(self._auth(authorization))
        await self.readiness.require()  # the worker / retriever may still be starting
        return await self.retriever.collections.remote()

    @app.get("/v1/admin/collections/{name}/versions")
    async def admin_versions(
        self, name: str, authorization: Annotated[str | None, Header()] = None
    ):
        """Admin: the versions of one collection, newest last."""
        KeyRing.require_admin(self._auth(authorization))
        await self.readiness.require()  # the worker / retriever may still be starting
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
        await self.readiness.require()  # the worker / retriever may still be starting
        roots = self.cfg.admin_sources
        source = allowed_source(body.source, roots)
        captions = allowed_source(body.captions, roots, "captions") if body.captions else None
        return await self.retriever.refresh.remote(name, source, captions)

    @app.post("/v1/admin/collections/{name}/rollback")
    async def admin_rollback(
        self,
        name: str,
        body: RollbackBody,
        authorization: Annotated[str | None, Header()] = None,
    ):
        """Admin: make an earlier version current again."""
        KeyRing.require_admin(self._auth(authorization))
        await self.readiness.require()  # the worker / retriever may still be starting
        return await self.retriever.rollback.remote(name, body.version)
