"""Typed errors -> OpenAI-style JSON error bodies (Ingress replica).

`install_error_handlers(app)` maps `mpic.errors.MPICError` subclasses to their own HTTP status
(401/403/404/410/413/415/400), request validation failures to 400 (as OpenAI and vLLM answer,
`param` naming the offending field), and unexpected exceptions to 500, always as
`{"error": {"message", "type", "param", "code"}}`. `error_body` gives the same body for an error
raised after a stream started (sent as an SSE `data:` event before the stream closes).

A 4xx answer is logged as one INFO line with the request id (`log_client_error`), never with a
traceback; the replicas behind the Ingress hand theirs back as values, not as failures Serve
would log (`mpic.deployments.client_errors`). Tracebacks are for 5xx.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mpic.deployments.http.schemas.errors import ErrorBody, ErrorDetail
from mpic.deployments.serve.admission import as_backpressure
from mpic.errors import MPICError, NotFoundError

logger = logging.getLogger(__name__)


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


class ModelNotFoundError(NotFoundError):
    """A request names a model this deployment does not serve (HTTP 404, like OpenAI)."""

    code = "model_not_found"


def _unwrap(exc: BaseException) -> BaseException:
    """The typed error inside a Ray task/actor error (a replica's exception as the caller
    sees it), else `exc`."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, MPICError):
        return cause
    for attr in ("as_instanceof_cause",):
        try:
            inner = getattr(exc, attr)()
        except Exception:  # noqa: BLE001 - not a Ray error
            continue
        if isinstance(inner, MPICError):
            return inner
    return exc


def status_of(exc: BaseException) -> int:
    """The HTTP status an exception answers with (500 for untyped ones)."""
    exc = _unwrap(exc)
    return exc.status if isinstance(exc, MPICError) else 500


def error_body(exc: BaseException) -> ErrorBody:
    """The OpenAI error body of any exception (untyped: a generic 500 message)."""
    exc = _unwrap(exc)
    if isinstance(exc, MPICError):
        message, _ = public_message(exc)
        detail = ErrorDetail(message=message, type=exc.type, param=exc.param, code=exc.code)
    else:
        detail = ErrorDetail(message=f"internal error: {type(exc).__name__}", type="server_error")
    return ErrorBody(error=detail)


def error_response(
    status: int,
    message: str,
    type_: str,
    code: str | None,
    param: str | None = None,
    retry_after: int | None = None,
    retry_after_ms: int | None = None,
) -> JSONResponse:
    """One OpenAI error body with `status` (with `Retry-After`, and `retry-after-ms` where the
    wait is known more finely: `mpic.deployments.serve.admission.retry_wait`)."""
    body = ErrorBody(error=ErrorDetail(message=message, type=type_, param=param, code=code))
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
        if retry_after_ms is not None:
            headers["retry-after-ms"] = str(retry_after_ms)
    return JSONResponse(body.model_dump(), status_code=status, headers=headers or None)


LOGGED_MESSAGE_CHARS = 300
"""A client error's message is logged up to this length (it may quote what the client sent)."""


def log_client_error(request: Request | None, status: int, code: str | None, message: str) -> None:
    """One INFO line for a client error (4xx) answered: request id, status, code, message (no
    traceback: the client's doing, not the server's)."""
    rid = getattr(getattr(request, "state", None), "request_id", None) or "-"
    if len(message) > LOGGED_MESSAGE_CHARS:
        message = message[:LOGGED_MESSAGE_CHARS] + "..."
    logger.info(
        "request %s answered %d %s: %s",
        rid,
        status,
        code or "-",
        message,
        extra={"request_id": rid},
    )


def mpic_error_response(exc: MPICError, request: Request | None = None) -> JSONResponse:
    """The response for a typed error (429/503 ones carry `Retry-After`); a 5xx is logged as a
    WARNING, a 4xx as one INFO line (`log_client_error`)."""
    message, retry = public_message(exc)  # no internals; Retry-After on every 503
    if exc.status >= 500:
        logger.warning("answering %d: %s", exc.status, exc.message)
    else:
        log_client_error(request, exc.status, exc.code, message)
    retry_ms = getattr(exc, "retry_after_ms", None)
    return error_response(exc.status, message, exc.type, exc.code, exc.param, retry, retry_ms)


_TYPE_LABEL = re.compile(r"^(str|int|float|bool|list|dict|none|[\w-]+\[.*\])$")
"""pydantic's union-member labels in an error location (`str`, `list[...]`, `function-after[...]`,
`tagged-union[...]`): not fields."""


def validation_param(error: dict, body: object = None) -> str | None:
    """The field a pydantic error is about, dotted (`messages.0.content.0.file.file_id`): the
    body/query prefix and pydantic's union-member labels are dropped. With the request `body`,
    the location is walked through it, so a segment that is neither a key nor an index of the
    input (a label such as a discriminator tag) is skipped; the last segment stays when it names
    a missing field."""
    loc = [p for p in error.get("loc", ()) if p not in ("body", "query", "path", "header")]
    out: list[str] = []
    node = body
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(node, Mapping) and part in node:  # a JSON object or a form
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif isinstance(part, str) and _TYPE_LABEL.match(part):
            continue
        elif body is not None and not (last and isinstance(node, Mapping)):
            continue
        out.append(str(part))
    return ".".join(out) or None


def _best_error(errors: list[dict]) -> dict:
    """The most specific of pydantic's errors: the one with the deepest location (of a union
    such as `str | list[part]`, the branch the input took, not the first branch tried)."""
    return max(errors, key=lambda e: len(e.get("loc", ())), default={})


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers on `app`."""

    @app.exception_handler(MPICError)
    async def _typed(request: Request, exc: MPICError) -> JSONResponse:
        return mpic_error_response(exc, request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        first = _best_error(errors)
        if first.get("type") == "json_invalid":  # loc is (body, char position): no field
            why = (first.get("ctx") or {}).get("error", "malformed JSON")
            message = f"the request body is not valid JSON ({why})"
            log_client_error(request, 400, "invalid_json", message)
            return error_response(400, message, "invalid_request_error", "invalid_json")
        param = validation_param(first, exc.body)
        if first.get("type") == "extra_forbidden":
            message = f"unrecognized request field: {param}"
        else:
            where = f"{param}: " if param else ""
            message = f"invalid request: {where}{first.get('msg', 'invalid body')}"
        log_client_error(request, 400, "invalid_request", message)
        return error_response(400, message, "invalid_request_error", "invalid_request", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code < 500:
            log_client_error(request, exc.status_code, "http_error", str(exc.detail))
        return error_response(
            exc.status_code, str(exc.detail), "invalid_request_error", "http_error"
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        inner = _unwrap(exc)
        if isinstance(inner, MPICError):  # a replica's typed error, wrapped by Ray
            return mpic_error_response(inner, request)
        if (busy := as_backpressure(exc)) is not None:  # Serve's queue bound: 429 Retry-After
            return mpic_error_response(busy, request)
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}", "server_error", None)
