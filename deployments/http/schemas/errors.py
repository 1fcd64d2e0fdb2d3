"""The error body of every 4xx/5xx answer (Ingress replica): OpenAI's `{"error": {"message",
"type", "param", "code"}}` (`mpic.deployments.http.http_errors` maps typed errors to it; the
OpenAPI document lists it as each route's error answer)."""

from __future__ import annotations

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    """OpenAI error object."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """`{"error": {...}}`, the body of every 4xx/5xx."""

    error: ErrorDetail
