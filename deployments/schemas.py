"""HTTP API bodies (Ingress replica): OpenAI's files and chat-completions shapes plus the `mpic`
extension object. Requests are strict (`extra="forbid"`) where MPIC defines them; OpenAI fields
that the SDK may send but MPIC does not use are accepted and ignored on the request root.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from mpic.retriever.spec import RetrievalSpec


class FileObject(BaseModel):
    """An uploaded file as `GET /v1/files/{id}` returns it (OpenAI `file` object + MPIC fields)."""

    id: str = Field(description="file-<hex>, unique per upload.")
    object: Literal["file"] = "file"
    bytes: int = Field(description="Size of the uploaded image in bytes.")
    created_at: int = Field(description="Unix seconds.")
    expires_at: int | None = Field(None, description="Unix seconds, None for no expiry.")
    filename: str = Field("", description="Name the client sent.")
    purpose: Literal["vision", "user_data"] = Field(description="Upload purpose.")
    status: Literal["processed", "expired"] = Field("processed", description="Cache state.")
    tokens: int = Field(description="Image tokens the cached entry holds (T).")


class FileList(BaseModel):
    """`GET /v1/files`."""

    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool = False


class FileDeleted(BaseModel):
    """`DELETE /v1/files/{id}`."""

    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class TextPart(BaseModel):
    """A text content part."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    """An inline image: a `data:image/...;base64,` URL (remote URLs are not fetched)."""

    model_config = ConfigDict(extra="forbid")
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(BaseModel):
    """An inline image part: encoded for this request only, not cached."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["image_url"]
    image_url: ImageURL


class FileRef(BaseModel):
    """A reference to an uploaded (cached) file."""

    model_config = ConfigDict(extra="forbid")
    file_id: str


class FilePart(BaseModel):
    """`{"type": "file", "file": {"file_id": ...}}`: a cached file linked by MPIC."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["file"]
    file: FileRef


ContentPart = Annotated[TextPart | ImagePart | FilePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    """One chat message; content is a string or a list of parts."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None


class MPICOptions(BaseModel):
    """The `mpic` extension object of a chat request."""

    model_config = ConfigDict(extra="forbid")
    policy: str = Field("mpic-32", description="Token-selection policy (linker registry name).")
    retrieval: RetrievalSpec | Literal["auto"] | None = Field(
        None,
        description="MRAG over a dynamic-library collection (mpic.retriever.query), or "
        '"auto": the default collection in auto mode (linked only when close enough).',
    )


class StreamOptions(BaseModel):
    """OpenAI `stream_options`."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """`POST /v1/chat/completions` body. Greedy decoding is what MPIC serves (temperature 0)."""

    model_config = ConfigDict(extra="ignore")
    model: str = Field(description="Any string; the deployment serves one model.")
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=4096)
    max_completion_tokens: int | None = Field(None, ge=1, le=4096)
    temperature: float | None = Field(None, ge=0, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    mpic: MPICOptions | None = None


class PromptTokensDetails(BaseModel):
    """`usage.prompt_tokens_details`; `cached_tokens` counts linked (reused) tokens."""

    cached_tokens: int = 0


class Usage(BaseModel):
    """OpenAI usage block."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class AssistantMessage(BaseModel):
    """The answer message."""

    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    """One non-streaming choice."""

    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    """Non-streaming response."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    mpic: dict[str, object] = Field(default_factory=dict, description="TTFT, policy, tiers.")


class Delta(BaseModel):
    """A streaming delta."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    """One streaming choice."""

    index: int = 0
    delta: Delta
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    """One SSE `data:` event."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ErrorDetail(BaseModel):
    """OpenAI error object."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """`{"error": {...}}`, the body of every 4xx/5xx."""

    error: ErrorDetail


class RefreshBody(BaseModel):
    """`POST /v1/admin/collections/{name}/refresh`."""

    model_config = ConfigDict(extra="forbid")
    source: str = Field(description="Folder or s3:// prefix holding the collection's images.")
    captions: str | None = Field(None, description="Optional captions JSONL (file, caption).")


class RollbackBody(BaseModel):
    """`POST /v1/admin/collections/{name}/rollback`."""

    model_config = ConfigDict(extra="forbid")
    version: str = Field(description="The version to make current again.")
