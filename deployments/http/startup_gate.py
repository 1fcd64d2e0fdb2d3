"""The start-up gate (Serve's HTTP proxy process): a JSON 503 `not_ready` for every request the
proxy cannot yet hand to a running Ingress replica.

Ray Serve's proxy listens on the HTTP port as soon as Serve starts, before the application is
deployed: until its route is registered the proxy answers every path with a plain-text 404
("Path '/v1/models' not found. Ping http://.../-/routes for available routes.", ~3.5 s of a
`mpic serve` start), and once the route is registered but before the proxy has heard of a running
Ingress replica, it holds each request in its router's queue until one runs (seconds on a busy
host). `StartupGate` is a Starlette middleware around the proxy's ASGI app, installed by
`mpic serve` through Ray Serve's proxy-callback hook: the environment variable
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` names `proxy_middlewares`, which every proxy process
calls as it starts (`ray.serve._private.http_util.configure_http_middlewares`), so the gate is in
place from the proxy's first accepted connection. Per request it asks the proxy's own router
(`ProxyRouter.match_route`, `DeploymentHandle.running_replicas_populated`, what the proxy itself
uses): a path that no route matches while no route is registered at all, or whose route's ingress
has no running replica the proxy knows of, gets at once 503 with `Retry-After` and the Ingress's
error body (`{"error": {"message", "type": "server_error", "param": null, "code":
"not_ready"}}`, `x-request-id`); everything else goes on to Serve unchanged (one prefix match per
request). Serve's own `/-/healthz` and `/-/routes` always pass (KubeRay probes them), and so does
a path outside every registered route (Serve's 404). Where the proxy's router cannot be found (a
Ray whose proxy differs from 2.60's) the gate lets everything pass, as if it were not installed.

From then on the Ingress answers: its readiness (`mpic.deployments.http.readiness`) gives the same
503 `not_ready` until every deployment can serve.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

logger = logging.getLogger(__name__)

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
"""Ray Serve's proxy-callback hook: an import path called in each proxy process at its start,
returning Starlette middlewares for the proxy's ASGI app."""

PROXY_CALLBACK = "mpic.deployments.http.startup_gate:proxy_middlewares"
"""`PROXY_CALLBACK_ENV`'s value that installs the gate (`mpic serve` sets it)."""

RETRY_AFTER_S = 1
"""`Retry-After` of the gate's 503s: the gate's window is the seconds until the Ingress runs."""

SERVE_PATHS = ("/-/healthz", "/-/routes")
"""The proxy's own routes: answered by Serve, gated or not."""

MESSAGE = "the service is starting (its HTTP ingress is not running yet); retry shortly"


def not_ready_body(message: str = MESSAGE) -> bytes:
    """The Ingress's `not_ready` error body (`http_errors.error_body` of a `NotReadyError`)."""
    error = {"message": message, "type": "server_error", "param": None, "code": "not_ready"}
    return json.dumps({"error": error}).encode()


def find_router(app: Any, depth: int = 8) -> Any:
    """The proxy's `ProxyRouter` behind `app` (the middlewares Serve wraps around its
    `HTTPProxy`, each holding the next as `app` or `_app`), or None."""
    for _ in range(depth):
        if app is None:
            return None
        router = getattr(app, "proxy_router", None)
        if router is not None:
            return router
        app = getattr(app, "app", None) or getattr(app, "_app", None)
    return None


def can_route(router: Any, path: str) -> bool:
    """Whether the proxy can hand a request for `path` to a running replica now (or has an answer
    of its own for it: a path outside every registered route)."""
    matched = router.match_route(path)
    if matched is None:
        return bool(getattr(router, "endpoints", None))  # routes exist, none for this path: 404
    handle = matched[1]
    return bool(handle.running_replicas_populated())


class StartupGate:
    """ASGI middleware around Serve's proxy app (see the module docstring)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._router: Any = None
        self._missing = False

    def _proxy_router(self) -> Any:
        if self._router is None and not self._missing:
            self._router = find_router(self.app)
            if self._router is None:
                self._missing = True
                logger.warning("start-up gate: no proxy router found; the gate is off")
        return self._router

    def _open(self, scope: dict) -> bool:
        path = scope.get("path", "")[len(scope.get("root_path", "")) :]
        if path in SERVE_PATHS:
            return True
        router = self._proxy_router()
        if router is None:
            return True
        try:
            return can_route(router, path)
        except Exception:  # noqa: BLE001 - a router unlike 2.60's: let Serve answer
            logger.warning("start-up gate: router check failed; the gate is off", exc_info=True)
            self._missing, self._router = True, None
            return True

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or self._open(scope):
            await self.app(scope, receive, send)
            return
        body = not_ready_body()
        rid = next(
            (v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"x-request-id"),
            uuid.uuid4().hex,
        )
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(RETRY_AFTER_S).encode()),
            (b"x-request-id", rid.encode("latin-1")),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def proxy_middlewares() -> list:
    """The proxy callback (`PROXY_CALLBACK`): the gate, outermost around Serve's proxy app."""
    from starlette.middleware import Middleware

    return [Middleware(StartupGate)]
