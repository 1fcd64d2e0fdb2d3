"""Per-request bookkeeping of the ingress (Ingress Serve replica): every request's id and its
count by route template and outcome, an HTTP middleware (`install_request_metrics`), and the
replica's metrics object the routes record generations and uploads on (`replica_metrics`,
`mpic.deployments.monitoring.metrics`).

The request id is Serve's (its proxy takes `X-Request-ID` when the client sends one and echoes it
in the `x-request-id` response header); outside Serve (in-process tests) the middleware takes the
header or makes an id, and echoes it itself.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from ray import serve

from mpic.deployments.monitoring.metrics import ServeMetrics

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
"""Routes whose requests are in flight until their body is sent (vllm:num_requests_waiting)."""

_METRICS: list[ServeMetrics] = []


def replica_metrics() -> ServeMetrics:
    """This process's metrics object (created in the replica, never pickled)."""
    if not _METRICS:
        _METRICS.append(ServeMetrics())
    return _METRICS[0]


def serve_request_id() -> str:
    """Serve's request id of the current request ("" outside a Serve replica)."""
    try:
        return serve.context._get_serve_request_context().request_id
    except Exception:  # noqa: BLE001 - outside a Serve replica (in-process tests)
        return ""


async def count_request(request: Request, call_next):
    """Count every request by route template and outcome. The request id is Serve's (its proxy
    takes `X-Request-ID` when sent and echoes it); outside Serve this middleware does both."""
    rid = serve_request_id()
    served = bool(rid)
    rid = rid or request.headers.get("x-request-id") or uuid.uuid4().hex
    request.state.request_id = rid
    generation = request.method == "POST" and request.url.path.endswith(GENERATION_PATHS)
    if generation:  # in flight until its body is sent (vllm:num_requests_waiting)
        replica_metrics().vllm.start()
    try:
        response = await call_next(request)
    except Exception:
        replica_metrics().request(_route(request), "500")
        if generation:
            replica_metrics().vllm.end()
        raise
    if generation:
        response.body_iterator = _ended(response.body_iterator, replica_metrics().vllm.end)
    outcome = "ok" if response.status_code < 400 else str(response.status_code)
    replica_metrics().request(_route(request), outcome)
    if not served:
        response.headers["x-request-id"] = rid
    return response


def install_request_metrics(app: FastAPI) -> None:
    """Count every request of `app`. Added after the guards, it is the outermost middleware:
    their refusals are counted too."""
    app.middleware("http")(count_request)


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
