"""Limits enforced before any work (Ingress and Encoder Serve replicas).

`RequestGuard` is a plain ASGI middleware in front of every route. From the headers alone it
answers 401 for a missing or unknown API key (before one byte of the body is read: an anonymous
1 GB upload costs nothing) and 413 for a declared `Content-Length` over the route's limit; while
the body streams in it counts bytes and stops reading at the limit (413), so nothing over the limit
is ever spooled. Uploads (`POST /v1/files`) may carry `limits.max_upload_bytes` plus a small
multipart allowance, every other route `limits.max_body_bytes`.

`check_chat_shape` bounds a parsed chat request (messages, content parts, text characters, no
lone UTF-16 surrogates) before it is resolved; `check_image_pixels` reads an image's size from its
header (PIL opens lazily: no pixel is decoded) and refuses decompression bombs with 413, and sides
or aspect ratios a processor's resize would blow up with 400.
"""

from __future__ import annotations

import io
import json
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from mpic.deployments.admission import EngineUnavailableError, as_backpressure
from mpic.errors import InvalidRequestError, PayloadTooLargeError, PromptTooLongError

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
    """What the guard of this process checks against (set by the Ingress replica at start)."""

    keys: Any = None
    """A `KeyRing` (None: not configured yet, every protected route 503)."""
    max_body_bytes: int = 1 << 20
    max_upload_bytes: int = 8 << 20


GUARD = GuardState()


def configure_guard(keys: Any, limits: Any) -> None:
    """Install this replica's key ring and limits (`LimitsConfig`) into the guard."""
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


class _TooLarge(Exception):
    pass


class RequestGuard:
    """ASGI middleware: auth from headers, then a counted body (see the module docstring)."""

    def __init__(self, app) -> None:
        self.app = app

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
        if GUARD.keys is not None:
            try:
                GUARD.keys.authenticate(headers.get("authorization"))
            except Exception as exc:  # noqa: BLE001 - AuthenticationError: 401, body unread
                status, body = _body(
                    401,
                    getattr(exc, "message", "unauthorized"),
                    "authentication_error",
                    "invalid_api_key",
                )
                return await _send_json(send, status, body, [(b"www-authenticate", b"Bearer")])
        upload = path == "/v1/files" and scope.get("method") == "POST"
        limit = GUARD.max_upload_bytes + MULTIPART_ALLOWANCE if upload else GUARD.max_body_bytes
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

        rewrite = False

        async def guarded_send(message):
            nonlocal started, rewrite
            if over:
                return  # the app's own answer to the cut body is replaced by our 413
            if message["type"] == "http.response.start" and _plain_503(message):
                rewrite = True  # Serve's own back-pressure answer (plain text, no Retry-After)
            if rewrite:
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    busy = EngineUnavailableError(
                        "the service is at capacity (request queue full); retry later",
                        retry_after=1,
                    )
                    status, body = _body(busy.status, busy.message, busy.type, busy.code)
                    await _send_json(send, status, body, [(b"retry-after", b"1")])
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
            else:  # Serve's queue bound, answered here so Serve's plain-text 503 never shows
                status, body = _body(busy.status, busy.message, busy.type, busy.code)
                retry = [(b"retry-after", str(busy.retry_after).encode())]
                return await _send_json(send, status, body, retry)
        if over and not started:
            await _send_json(send, *_too_large(what, limit))


def _too_large(what: str, limit: int) -> tuple[int, bytes]:
    return _body(
        413, f"{what} over the {limit}-byte limit", "invalid_request_error", "payload_too_large"
    )


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield str(k)
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


def check_chat_shape(body: Any, limits: Any) -> None:
    """400 for a chat request over `limits` (messages, parts per message, text characters) or
    holding text that is not valid Unicode (a lone surrogate such as `\\ud800`)."""
    messages = body.messages
    if len(messages) > limits.max_messages:
        raise InvalidRequestError(
            f"{len(messages)} messages; at most {limits.max_messages} are allowed",
            param="messages",
        )
    chars = 0
    for i, msg in enumerate(messages):
        content = getattr(msg, "content", None)
        if isinstance(content, list) and len(content) > limits.max_content_parts:
            raise InvalidRequestError(
                f"message {i} has {len(content)} content parts; at most "
                f"{limits.max_content_parts} are allowed",
                param=f"messages.{i}.content",
            )
    for text in _strings(body.model_dump(exclude_none=True)):
        chars += len(text)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequestError(
                "the request holds text that is not valid Unicode (a lone surrogate)",
                param="messages",
            ) from None
    if chars > limits.max_text_chars:
        raise PromptTooLongError(
            f"the request holds {chars} characters of text; at most {limits.max_text_chars}",
            param="messages",
        )


class ImageSizeError(InvalidRequestError):
    """An image side or aspect ratio over the limits (HTTP 400, code `invalid_image_size`)."""

    code = "invalid_image_size"


def check_image_pixels(
    data: bytes, max_pixels: int, max_side: int | None = None, max_aspect: float | None = None
) -> None:
    """Refuse an image from its header alone (PIL opens lazily: no pixel is decoded, nothing is
    resized): 413 when it declares more than `max_pixels` pixels (decompression bombs), 400 when
    a side is over `max_side` or the longest side over the shortest is over `max_aspect` (resize
    bombs: a 100,000 x 1 image whose short side a processor scales up to 336 pixels would become
    33.6 M x 336). Bytes PIL cannot identify pass through (the engine answers 415 for them)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as im:
                width, height = im.size
                frames = getattr(im, "n_frames", 1)
    except Image.DecompressionBombError:
        raise PayloadTooLargeError(
            f"image over the {max_pixels}-pixel limit", param="file"
        ) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        return
    if width * height > max_pixels or width * height * frames > 4 * max_pixels:
        raise PayloadTooLargeError(
            f"image of {width}x{height} pixels is over the {max_pixels}-pixel limit", param="file"
        )
    if min(width, height) < 1 or (max_side is not None and max(width, height) > max_side):
        raise ImageSizeError(
            f"image of {width}x{height} pixels: each side must be 1 to {max_side} pixels",
            param="file",
        )
    if max_aspect is not None and max(width, height) > max_aspect * min(width, height):
        raise ImageSizeError(
            f"image of {width}x{height} pixels: the aspect ratio is over {max_aspect:g}:1",
            param="file",
        )


def policy_label(policy: str) -> str:
    """The bounded metrics label of a policy name: its family (`mpic-32` -> `mpic`,
    `vlcache-0.1:0.2` -> `vlcache`), or "other" for anything not a known family, so no request
    can create a time series of its own."""
    from mpic.linker.policies import POLICY_NAMES

    families = {n.split("-<", 1)[0] for n in POLICY_NAMES}
    if policy in families:
        return policy
    head = policy.rsplit("-", 1)[0] if "-" in policy else policy
    return head if head in families and "<" not in head else "other"


ERROR_RESPONSES: dict[int, str] = {
    400: "Invalid request (a field names the problem in `param`); also context_length_exceeded.",
    401: "Missing or unknown API key (checked before the body is read).",
    403: "A valid key without the rights for this route (admin routes).",
    404: "Unknown id, another user's id, or a model this deployment does not serve.",
    410: "The file expired, or its cached data and media are lost.",
    413: "Body, upload or image over the configured limits.",
    415: "The upload is not a decodable image or a supported document.",
    429: "The engine's budget is spent; retry after `Retry-After` seconds.",
    503: "The engine restarts, a queue is full or the object store is unreachable; retry after "
    "`Retry-After` seconds.",
    507: "The object store is full (nothing of the upload is kept); retry after `Retry-After` "
    "seconds.",
}
"""The error statuses the API answers, each with an OpenAI-style `ErrorBody`."""


def install_openapi_errors(app: Any, error_schema: Any) -> None:
    """Make `app`'s OpenAPI document list the real error answers: every non-public operation
    gets 400/401/403/404/410/413/415/429/503 with `error_schema` (the OpenAI error body), and
    FastAPI's 422 (never sent: validation errors answer 400) is removed."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        name = error_schema.__name__
        schemas[name] = error_schema.model_json_schema(ref_template="#/components/schemas/{model}")
        for defs_name, sub in schemas[name].pop("$defs", {}).items():
            schemas.setdefault(defs_name, sub)
        retry = {"Retry-After": {"schema": {"type": "integer"}, "description": "Seconds."}}
        for path, ops in doc.get("paths", {}).items():
            for op in ops.values():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                if path in PUBLIC_PATHS:
                    continue
                for status, text in ERROR_RESPONSES.items():
                    body = {
                        "application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}
                    }
                    responses[str(status)] = {"description": text, "content": body}
                    if status in (429, 503, 507):
                        responses[str(status)]["headers"] = retry
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi


_OBJECT_REPR = re.compile(r"<[\w.]+ object at 0x[0-9a-fA-F]+>")


def public_message(exc: Any) -> tuple[str, int | None]:
    """What a client may see of a typed error: (message, Retry-After seconds or None).

    5xx errors other than the admission ones (which carry `retry_after` and clean messages) get a
    generic message (no store key, endpoint or path: those stay in the server's log); 4xx
    messages lose Python object representations (`<_io.BytesIO object at 0x...>`). Every 503
    carries a Retry-After."""
    retry = getattr(exc, "retry_after", None)
    status = getattr(exc, "status", 500)
    if status >= 500 and retry is None:
        message = (
            "a backing service (object store) is unreachable; retry shortly"
            if status == 503
            else "internal error"
        )
    else:
        message = _OBJECT_REPR.sub("the data", exc.message)
    if status == 503 and retry is None:
        retry = 5
    return message, retry
