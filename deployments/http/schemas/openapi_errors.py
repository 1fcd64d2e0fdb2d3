"""The API's error answers in its OpenAPI document (Ingress Serve replica): every protected
operation lists the statuses it can answer with the OpenAI-style error body; FastAPI's 422 (never
sent: validation errors answer 400) is removed."""

from __future__ import annotations

from typing import Any

from mpic.deployments.http.request_guard import PUBLIC_PATHS

ERROR_RESPONSES: dict[int, str] = {
    400: "Invalid request (a field names the problem in `param`); also context_length_exceeded.",
    401: "Missing or unknown API key (checked before the body is read).",
    403: "A valid key without the rights for this route (admin routes).",
    404: "Unknown id, another user's id, or a model this deployment does not serve.",
    410: "The file expired, or its cached data and media are lost.",
    413: "Body, upload or image over the configured limits.",
    415: "The upload is not a decodable image or a supported document.",
    429: "The engine's budget is spent or the TTFT target would break; retry after "
    "`Retry-After` seconds (`retry-after-ms`: the same wait in milliseconds).",
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
        ms = "Milliseconds, the same wait (OpenAI's clients read it first); on load refusals."
        retry_429 = {**retry, "retry-after-ms": {"schema": {"type": "integer"}, "description": ms}}
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
                        responses[str(status)]["headers"] = retry_429 if status == 429 else retry
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
