"""The request guard in front of every route (Ingress Serve replica).

`RequestGuard` is a plain ASGI middleware. From the headers alone it answers 401 for a missing or
unknown API key (before one byte of the body is read: an anonymous 1 GB upload costs nothing) and
413 for a declared `Content-Length` over the route's limit; while the body streams in it counts
bytes and stops reading at the limit (413), so nothing over the limit is ever spooled. Uploads
(`POST /v1/files`) may carry `limits.max_upload_bytes` plus a small multipart allowance, every
other route `limits.max_body_bytes`. Ray Serve's own plain-text 503 is rewritten into the
OpenAI-style JSON body with a Retry-After: its queue bound ("Request dropped due to backpressure",
load) as 429 `engine_overloaded`, any other as 503 `engine_unavailable`; Serve's back-pressure
error raised through the app is answered 429 `engine_overloaded` too
(`mpic.deployments.serve.admission.as_backpressure`).

What the guard checks against is `GUARD`, this process's `GuardState`, installed by the Ingress
replica at start (`configure_guard`). It is process state on purpose: `serve.ingress` freezes the
FastAPI app (a cloudpickled copy) when the class is decorated, so neither the replica object nor
the module-level `app` it sees is the app that serves; a module imported by reference is the one
place both reach. A test can pass its own `GuardState` to `RequestGuard`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from mpic.deployments.serve.admission import (
    EngineUnavailableError,
    OverloadedError,
    as_backpressure,
    queue_full,
    retry_headers,
)

PUBLIC_PATHS = (
    "/healthz",
    "/readyz",
    "/health",
    "/version",
    "/metrics",
    "/openapi.json",
    "/docs",
    "/redoc",
)
"""Routes that need no API key (probes, scraping, the API description)."""
MULTIPART_ALLOWANCE = 64 * 1024
"""Bytes an upload's multipart framing and form fields may add to `max_upload_bytes`."""


@dataclass
class GuardState:
    """What a guard checks against."""

    keys: Any = None
    """A `KeyRing` (None: not installed, no key is asked for)."""
    max_body_bytes: int = 1 << 20
    max_upload_bytes: int = 8 << 20


GUARD = GuardState()
"""This process's guard state (see the module docstring)."""


def configure_guard(keys: Any, limits: Any) -> None:
    """Install this replica's key ring and limits (`LimitsConfig`) into `GUARD`."""
    GUARD.keys = keys
    GUARD.max_body_bytes = limits.max_body_bytes
    GUARD.max_upload_bytes = limits.max_upload_bytes


def _body(status: int, message: str, type_: str, code: str) -> tuple[int, bytes]:
    err = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return status, json.dumps(err).encode()


async def _send_json(send, status: int, body: bytes, extra: Iterable[tuple[bytes, bytes]] = ()):
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": [*headers, *extra]})
    await send({"type": "http.response.body", "body": body})


def _plain_503(start: dict) -> bool:
    """A 503 whose body is not our JSON (Ray Serve answers its queue bound in plain text)."""
    if start.get("status") != 503:
        return False
    types = [v for k, v in start.get("headers", []) if k.lower() == b"content-type"]
    return not any(b"json" in v for v in types)


def _plain_503_as(body: bytes) -> OverloadedError | EngineUnavailableError:
    """What Serve's plain-text 503 stands for: its queue bound ("Request dropped due to
    backpressure") is load (429 `engine_overloaded`), anything else an unavailable service."""
    if b"backpressure" in body.lower():
        return queue_full()
    return EngineUnavailableError("the service is unavailable; retry shortly", retry_after=1)


class _TooLarge(Exception):
    pass


class RequestGuard:
    """ASGI middleware: auth from headers, then a counted body (see the module docstring).

    It checks against `state`, by default this process's `GUARD`."""

    def __init__(self, app, state: GuardState = GUARD) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        if path in PUBLIC_PATHS or path.startswith("/docs"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        guard = self.state
        if guard.keys is not None:
            try:
                guard.keys.authenticate(headers.get("authorization"))
            except Exception as exc:  # noqa: BLE001 - AuthenticationError: 401, body unread
                status, body = _body(
                    401,
                    getattr(exc, "message", "unauthorized"),
                    "authentication_error",
                    "invalid_api_key",
                )
                return await _send_json(send, status, body, [(b"www-authenticate", b"Bearer")])
        upload = path == "/v1/files" and scope.get("method") == "POST"
        limit = guard.max_upload_bytes + MULTIPART_ALLOWANCE if upload else guard.max_body_bytes
        what = "upload" if upload else "request body"
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return await _send_json(send, *_too_large(what, limit))
        seen, started, over = 0, False, False

        async def counted_receive():
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    over = True
                    raise _TooLarge
            return message

        rewrite, plain = False, b""

        async def guarded_send(message):
            nonlocal started, rewrite, plain
            if over:
                return  # the app's own answer to the cut body is replaced by our 413
            if message["type"] == "http.response.start" and _plain_503(message):
                rewrite = True  # Serve's own answer (plain text, no Retry-After)
            if rewrite:
                if message["type"] == "http.response.body":
                    plain += message.get("body", b"")[:4096]
                    if not message.get("more_body"):
                        busy = _plain_503_as(plain)
                        status, body = _body(busy.status, busy.message, busy.type, busy.code)
                        retry = retry_headers(
                            busy.retry_after, getattr(busy, "retry_after_ms", None)
                        )
                        await _send_json(send, status, body, retry)
                started = True
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except _TooLarge:
            pass
        except Exception as exc:
            if over:
                pass
            elif started or (busy := as_backpressure(exc)) is None:
                raise
            else:  # Serve's queue bound (429), answered here so Serve's plain 503 never shows
                status, body = _body(busy.status, busy.message, busy.type, busy.code)
                retry = retry_headers(busy.retry_after, getattr(busy, "retry_after_ms", None))
                return await _send_json(send, status, body, retry)
        if over and not started:
            await _send_json(send, *_too_large(what, limit))


def _too_large(what: str, limit: int) -> tuple[int, bytes]:
    return _body(
        413, f"{what} over the {limit}-byte limit", "invalid_request_error", "payload_too_large"
    )
