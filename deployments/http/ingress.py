"""The HTTP ingress (Ingress Serve replica): the FastAPI app of the OpenAI-compatible API, the
`Ingress` deployment class, and its liveness, readiness, metrics and model routes.

The app's other routes are methods of the `Ingress`'s base classes, each on a router of its own
module that the app includes: chat (`mpic.deployments.http.chat_routes`), files
(`mpic.deployments.http.file_routes`), admin (`mpic.deployments.http.admin_routes`) and vLLM's
non-chat routes (`mpic.deployments.http.vllm_routes`). Around them: the request guard (auth and
body limits before any body is read), TTFT shedding, and the request id and counts of every
request (`mpic.deployments.http.request_metrics`).

Only small things cross HTTP: image bytes on upload, text and ids on queries. Every request
carries a request id (Serve's, taken from an `X-Request-ID` header when the client sends one): it
is in every log line of every deployment that handles the request (Serve's JSON logs), in the
`LinkedPrompt` the engine receives, and in the `x-request-id` response header. Every request is
counted by route template and outcome (`mpic.deployments.monitoring.metrics`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Annotated, Literal

from fastapi import FastAPI, Header
from fastapi.responses import Response
from pydantic import BaseModel, Field
from ray import serve
from ray.serve.handle import DeploymentHandle

from mpic.deployments.client_errors import raising
from mpic.deployments.config import ServeAppConfig
from mpic.deployments.http import admin_routes, chat_routes, file_routes
from mpic.deployments.http.admin_routes import AdminRoutes
from mpic.deployments.http.auth import KeyRing, Principal
from mpic.deployments.http.chat_routes import ChatRoutes
from mpic.deployments.http.file_routes import FileRoutes
from mpic.deployments.http.http_errors import ModelNotFoundError, install_error_handlers
from mpic.deployments.http.readiness import AppReadiness, NotReadyError, replica_probe
from mpic.deployments.http.request_guard import RequestGuard, configure_guard
from mpic.deployments.http.request_metrics import install_request_metrics, replica_metrics
from mpic.deployments.http.schemas.errors import ErrorBody
from mpic.deployments.http.schemas.openapi_errors import install_openapi_errors
from mpic.deployments.http.shedding import SheddingGuard, configure_shedding
from mpic.deployments.http.vllm_routes import VllmRoutes
from mpic.deployments.http.vllm_routes import router as vllm_router
from mpic.deployments.messages import DoneEvent
from mpic.deployments.monitoring.metrics import metrics_page
from mpic.deployments.monitoring.replica_logs import use_serve_logging
from mpic.deployments.serve.admission import engine_batch
from mpic.deployments.serve.files import FileCatalog

logger = logging.getLogger(__name__)

app = FastAPI(title="MPIC serve", version="0.1.0")
install_error_handlers(app)
app.add_middleware(SheddingGuard)  # inside the guard: TTFT admission of authorised requests
app.add_middleware(RequestGuard)  # auth + body limits from the headers, before any body read
install_request_metrics(app)  # outermost: request id, counts by route and outcome
install_openapi_errors(app, ErrorBody)  # the real error answers, no 422
app.include_router(vllm_router)  # vLLM's other routes: /v1/completions, /tokenize, ... (VllmRoutes)
app.include_router(file_routes.router)  # /v1/files* (FileRoutes)
app.include_router(chat_routes.router)  # /v1/chat/completions (ChatRoutes)
app.include_router(admin_routes.router)  # /v1/admin/* (AdminRoutes)

MODEL_INFO_WAIT_S = 1.0
"""The longest a request waits for the LLM worker's first answer of its context length."""


class Model(BaseModel):
    """`GET /v1/models/{id}`: the served model."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mpic"
    root: str | None = Field(None, description="The model folder or S3 prefix served (vLLM).")
    max_model_len: int | None = Field(None, description="Context length in tokens (vLLM).")


class ModelList(BaseModel):
    """`GET /v1/models`."""

    object: Literal["list"] = "list"
    data: list[Model]


# Helpers must be defined above the class: `serve.ingress` serializes the class when it is
# decorated, with the module globals that exist at that moment.
def _seen(task: asyncio.Task) -> None:
    """Mark a background task's outcome as retrieved (no "never retrieved" log line)."""
    if not task.cancelled():
        task.exception()


@serve.ingress(app)
class Ingress(ChatRoutes, FileRoutes, AdminRoutes, VllmRoutes):
    """Routes `/healthz`, `/readyz`, `/metrics` and `/v1/models*` here; `/v1/chat/completions`,
    `/v1/files*`, `/v1/admin/*` and vLLM's other routes from its base classes."""

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
        configure_shedding(config.limits, engine_batch(config))  # vLLM: batching-aware
        if not len(self.keys):
            logger.warning("no API keys configured: every request will get 401")
        self.files = FileCatalog(config.store)
        # a replica's client error (a value, `mpic.deployments.client_errors`) raises here
        self.encoder, self.resolver = raising(encoder), raising(resolver)
        self.worker, self.retriever = raising(worker), raising(retriever)
        self.started = int(time.time())
        self.max_model_len: int | None = None  # asked of the LLM worker once it can serve
        self._length_task: asyncio.Task | None = None
        replica_metrics().model_name = config.engine.served_names[0]
        # the context length is asked of the LLM worker as soon as the app is ready
        self.readiness = AppReadiness(replica_probe(), on_ready=self._length_pending)
        self.readiness.start()  # polled from the replica's start, not from its first request

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
        replica_metrics().record(policy, done, ttft_s, decode_s)

    def _check_model(self, name: str) -> None:
        names = self.cfg.engine.served_names
        if name not in names:
            served = names[0] if len(names) == 1 else names
            raise ModelNotFoundError(
                f"The model {name!r} does not exist; this deployment serves {served!r} "
                "(GET /v1/models)",
                param="model",
            )
