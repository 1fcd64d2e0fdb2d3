"""Typed errors -> OpenAI-style JSON error bodies (Ingress replica).

`install_error_handlers(app)` maps `mpic.errors.MPICError` subclasses to their own HTTP status
(401/403/404/410/413/415/400), request-body validation failures to 422, and unexpected
exceptions to 500, always as `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mpic.deployments.schemas import ErrorBody, ErrorDetail
from mpic.errors import MPICError

logger = logging.getLogger(__name__)


def error_response(
    status: int, message: str, type_: str, code: str | None, param: str | None = None
) -> JSONResponse:
    """One OpenAI error body with `status`."""
    body = ErrorBody(error=ErrorDetail(message=message, type=type_, param=param, code=code))
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def mpic_error_response(exc: MPICError) -> JSONResponse:
    """The response for a typed error."""
    return error_response(exc.status, exc.message, exc.type, exc.code, exc.param)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers on `app`."""

    @app.exception_handler(MPICError)
    async def _typed(_: Request, exc: MPICError) -> JSONResponse:
        return mpic_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        message = f"malformed request: {first.get('msg', 'invalid body')}"
        return error_response(422, message, "invalid_request_error", "invalid_body", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(
            exc.status_code, str(exc.detail), "invalid_request_error", "http_error"
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}", "server_error", None)
