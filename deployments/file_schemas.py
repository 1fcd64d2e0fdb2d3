"""The file objects of the HTTP API (Ingress replica; the file catalog and the LLM worker build
them, so they sit below both `deployments/http/` and `deployments/serve/`): OpenAI's `file` object
with MPIC's fields (status, tokens), its list page, and the bodies of the expiry update and the
delete.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mpic.errors import InvalidRequestError


class FileObject(BaseModel):
    """An uploaded file as `GET /v1/files/{id}` returns it (OpenAI `file` object + MPIC fields)."""

    id: str = Field(description="file-<hex>, unique per upload.")
    object: Literal["file"] = "file"
    bytes: int = Field(description="Size of the uploaded image in bytes.")
    created_at: int = Field(description="Unix seconds.")
    expires_at: int | None = Field(None, description="Unix seconds, None for no expiry.")
    filename: str = Field("", description="Name the client sent.")
    purpose: Literal["vision", "user_data"] = Field(description="Upload purpose.")
    status: Literal["processed", "expired", "lost"] = Field(
        "processed", description="processed: cached; lost: entry and media gone (410 on use)."
    )
    status_details: str | None = Field(None, description="Why a file is lost.")
    tokens: int = Field(description="Image tokens the cached entry holds (T).")


class FileList(BaseModel):
    """`GET /v1/files` (OpenAI cursor pagination)."""

    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


class FileExpiryUpdate(BaseModel):
    """`POST /v1/files/{id}`: a new expiry, either `ttl_seconds` from now (Gemini's `ttl`) or
    OpenAI's `expires_after` (seconds after the file's creation)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    ttl_seconds: int | None = Field(
        None, ge=1, le=10**10, description="Expire this many seconds from now."
    )
    expires_after: ExpiresAfter | None = None

    @model_validator(mode="after")
    def _one(self) -> FileExpiryUpdate:
        if (self.ttl_seconds is None) == (self.expires_after is None):
            raise InvalidRequestError(
                "give exactly one of ttl_seconds and expires_after", param="ttl_seconds"
            )
        return self


class ExpiresAfter(BaseModel):
    """OpenAI `expires_after`."""

    model_config = ConfigDict(extra="forbid", strict=True)
    anchor: Literal["created_at"] = "created_at"
    seconds: int = Field(ge=1, le=10**10)


class FileDeleted(BaseModel):
    """`DELETE /v1/files/{id}`."""

    id: str
    object: Literal["file"] = "file"
    deleted: bool = True
