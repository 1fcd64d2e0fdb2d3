"""HTTP bodies of the vLLM-compatible routes (Ingress replica): OpenAI's legacy
`/v1/completions` and vLLM's `/tokenize`, `/detokenize` and `/version`, in vLLM's shapes. Strict
like the chat bodies: a field is honoured or answered with a 400 naming it (`extra="forbid"`),
and strictly typed (`strict=True`: no string for a number or a boolean, no bool for an int).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mpic.deployments.chat_request import (
    MPICOptions,
    StreamOptions,
    VllmSamplingFields,
    check_logit_bias,
)
from mpic.deployments.http.schemas.answers import Usage
from mpic.deployments.messages import Sampling
from mpic.errors import InvalidRequestError
from mpic.linker.chat_template import (
    ChatTemplateOptions,
    check_final_message,
    template_options,
)


class CompletionMPICOptions(MPICOptions):
    """The `mpic` extension of a completion: the chat options plus `files`, uploaded files
    (images excluded: a template-free prompt has no image placeholder; text documents) linked
    before the prompt text, in order."""

    files: list[str] = Field(
        default_factory=list, max_length=64, description="file ids linked before the prompt."
    )


class CompletionRequest(VllmSamplingFields):
    """`POST /v1/completions` body (OpenAI legacy completions, as vLLM serves them). The prompt
    is text (a string, or a list of strings: one choice set per prompt); token-id prompts,
    `echo`, `suffix` and `best_of` > n are refused with a 400 naming the field."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(description="The served model id (`GET /v1/models`); others get 404.")
    prompt: str | list[str] | list[int] | list[list[int]] = Field(description="Text prompt(s).")
    max_tokens: int | None = Field(16, ge=1, le=4096, description="Tokens to generate.")
    temperature: float | None = Field(None, ge=0, le=2, description="0: greedy (default).")
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=8)
    best_of: int | None = Field(None, ge=1, le=8, description="Only equal to n (or absent).")
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=20, description="Top alternatives per token.")
    echo: bool | None = Field(None, description="Only false: the prompt is not echoed.")
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    suffix: str | None = Field(None, description="Insertion is not supported: 400.")
    user: str | None = None
    ignore_eos: bool | None = Field(None, description="vLLM: decode past end-of-sequence ids.")
    mpic: CompletionMPICOptions | None = None

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if not self.prompts:
            raise InvalidRequestError(
                "prompt: text (a string or a list of strings) is served; token-id prompts are "
                "not (tokenize with /tokenize and send the text)",
                param="prompt",
            )
        if self.echo:
            raise InvalidRequestError("echo: the prompt is not echoed", param="echo")
        if self.suffix:
            raise InvalidRequestError("suffix: insertion is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of: only equal to n", param="best_of")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > 4 or any(not s for s in stops):
            raise InvalidRequestError("stop: at most 4 non-empty strings", param="stop")
        check_logit_bias(self.logit_bias)
        return self

    @property
    def prompts(self) -> list[str]:
        """The text prompts ([] when the prompt is token ids)."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and all(isinstance(p, str) for p in self.prompt):
            return list(self.prompt)  # type: ignore[arg-type]
        return []

    def sampling(self) -> Sampling:
        """The engine-side `Sampling` of this request."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        sampling = Sampling(
            temperature=self.temperature or 0.0,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            stop=stops,
            logprobs=self.logprobs,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            **self.vllm_sampling(),
        )
        if self.ignore_eos and hasattr(sampling, "ignore_eos"):
            sampling.ignore_eos = True
        return sampling


class CompletionLogprobs(BaseModel):
    """`choices[i].logprobs` of a completion (OpenAI legacy shape)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One completion choice (also one streamed piece)."""

    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class Completion(BaseModel):
    """`/v1/completions` answer, and (object `text_completion` too, as vLLM sends) each SSE
    event of a streamed one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    mpic: dict[str, Any] | None = None


class TokenizeRequest(BaseModel):
    """vLLM's `/tokenize`: a text `prompt`, or chat `messages` (text only) rendered by the chat
    template as `/v1/chat/completions` renders them."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, description="The served model id (optional).")
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = Field(None, max_length=256)
    add_special_tokens: bool | None = Field(
        None, description="prompt: default true; messages: default false (the template has them)."
    )
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(
        False, description="messages: the last (assistant) message left open, as in chat."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="messages: extra variables of the chat template, as in chat."
    )
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
        for i, msg in enumerate(self.messages or []):
            if not isinstance(msg.get("role"), str) or "content" not in msg:
                raise InvalidRequestError(
                    "each message needs a role and a content", param=f"messages.{i}"
                )
        template = self.template_options()
        if self.messages is not None:
            check_final_message(template, self.messages[-1]["role"] if self.messages else None)
        return self

    def template_options(self) -> ChatTemplateOptions | None:
        """How the chat template renders `messages` (as the chat route's, `mpic.linker
        .chat_template`); None: the default rendering."""
        return template_options(
            self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs
        )


class TokenizeResponse(BaseModel):
    """vLLM's `/tokenize` answer."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    """vLLM's `/detokenize`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


class DetokenizeResponse(BaseModel):
    """vLLM's `/detokenize` answer."""

    prompt: str


class VersionResponse(BaseModel):
    """vLLM's `/version` answer: this server's version."""

    version: str
