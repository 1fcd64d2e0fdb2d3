"""The bodies a generation answers with (Ingress replica): OpenAI's usage block (its
`prompt_tokens_details.cached_tokens` counts linked tokens), the per-token logprobs, a
non-streaming chat completion and the chunks of a streamed one. Completions
(`mpic.deployments.http.schemas.completions`) share the usage block."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


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


class TopLogprob(BaseModel):
    """One alternative token."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class LogprobContent(TopLogprob):
    """One generated token with its most likely alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    """`choices[i].logprobs`."""

    content: list[LogprobContent]


class Choice(BaseModel):
    """One non-streaming choice."""

    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: ChoiceLogprobs | None = None


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
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    """One SSE `data:` event."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
