"""Typed errors shared by every subsystem; the HTTP layer maps them to OpenAI-style JSON bodies.

Runs in every process. Each error carries the HTTP status it maps to and an OpenAI error `type`.
"""

from __future__ import annotations


class MPICError(Exception):
    """Base class: `status` is the HTTP status, `type` the OpenAI error type, `code` a slug."""

    status: int = 500
    type: str = "server_error"
    code: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(MPICError):
    """Malformed or unusable input (HTTP 400/422)."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class NotFoundError(MPICError):
    """Unknown id, or an id owned by another user: the same answer for both (HTTP 404)."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ExpiredError(MPICError):
    """The file existed for this user but its TTL has passed (HTTP 410)."""

    status = 410
    type = "invalid_request_error"
    code = "expired"


class PromptTooLongError(InvalidRequestError):
    """The linked prompt is longer than the model's context (HTTP 400)."""

    code = "context_length_exceeded"


class UnreadableMediaError(MPICError):
    """The bytes are not a decodable image (HTTP 415)."""

    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class PayloadTooLargeError(MPICError):
    """Upload over the configured size limit (HTTP 413)."""

    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class CorruptEntryError(MPICError):
    """A stored cache entry failed its checksum or could not be decoded; callers recompute."""

    code = "corrupt_entry"


class AuthenticationError(MPICError):
    """Missing or unknown API key (HTTP 401)."""

    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class PermissionDeniedError(MPICError):
    """A valid key without the rights for this call, e.g. admin routes (HTTP 403)."""

    status = 403
    type = "permission_error"
    code = "forbidden"
