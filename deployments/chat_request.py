"""The chat request body of the HTTP API (Ingress replica; the Resolver reads it, so it sits
below both `deployments/http/` and `deployments/serve/`): `POST /v1/chat/completions`'s messages
and content parts (text, inline images, cached files), the `mpic` extension object, and the
checks every OpenAI field passes. Requests are strict (`extra="forbid"`): an OpenAI field is
honoured or rejected with a 400 naming it, never silently ignored; and strictly typed
(`strict=True`): no bool for an int (`max_tokens: true`), no string for a bool (`stream: "yes"`),
no float for an int (an int is accepted for a float, as JSON has one number type).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mpic.deployments.messages import Sampling
from mpic.errors import InvalidRequestError
from mpic.linker.chat_template import ChatTemplateOptions, check_final_message, template_options
from mpic.presses import PRESS_NAMES
from mpic.retriever.spec import RetrievalSpec


def check_logit_bias(logit_bias: dict[str, float] | None) -> None:
    """The logit_bias check chat and completion requests share: keys are token ids, biases in
    [-100, 100]."""
    for key, bias in (logit_bias or {}).items():
        if not key.isdigit() or not -100 <= bias <= 100:
            raise InvalidRequestError(
                "logit_bias maps token ids to biases in [-100, 100]", param="logit_bias"
            )


class VllmSamplingFields(BaseModel):
    """vLLM's sampling extensions, fields of both chat and completion bodies (`extra_body` with
    OpenAI's client)."""

    top_k: int | None = Field(
        None, ge=-1, description="vLLM extension: sample among the k likeliest tokens (0, -1: all)."
    )
    min_p: float | None = Field(
        None,
        ge=0,
        le=1,
        description="vLLM extension: drop tokens below min_p x the likeliest one's probability.",
    )
    repetition_penalty: float | None = Field(
        None,
        gt=0,
        le=100,
        description="vLLM extension: divides (multiplies, where negative) the logits of the "
        "prompt's and the answer's tokens (1: none).",
    )
    min_tokens: int | None = Field(
        None,
        ge=0,
        le=4096,
        description="vLLM extension: no end token and no stop string before this many tokens.",
    )

    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None,
        max_length=64,
        description="vLLM extension: token ids that end the answer (counted, not in its text).",
    )
    include_stop_str_in_output: bool | None = Field(
        None, description="vLLM extension: keep the matched stop string (or stop token's text)."
    )
    skip_special_tokens: bool | None = Field(
        None, description="vLLM extension: leave special tokens out of the text (default true)."
    )
    spaces_between_special_tokens: bool | None = Field(
        None,
        description="vLLM extension: spaces around special tokens in the text, where the "
        "tokenizer's decode adds them (default: the tokenizer's own).",
    )

    def vllm_sampling(self) -> dict[str, Any]:
        """The `Sampling` keywords of the extensions this body sets (absent: the defaults)."""
        names = (
            "top_k",
            "min_p",
            "repetition_penalty",
            "min_tokens",
            "stop_token_ids",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        )
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


class TextPart(BaseModel):
    """A text content part."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    """An inline image: a `data:image/...;base64,` URL (remote URLs are not fetched)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    url: str
    detail: Literal["auto", "low", "high"] | None = Field(
        None, description='Only "auto" (the model\'s own resolution); low/high: 400.'
    )


class ImagePart(BaseModel):
    """An inline image part: encoded for this request only, not cached."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["image_url"]
    image_url: ImageURL


class FileRef(BaseModel):
    """A reference to an uploaded (cached) file."""

    model_config = ConfigDict(extra="forbid", strict=True)
    file_id: str


class FilePart(BaseModel):
    """`{"type": "file", "file": {"file_id": ...}}`: a cached file linked by MPIC."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["file"]
    file: FileRef


ContentPart = Annotated[TextPart | ImagePart | FilePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    """One chat message; content is a string or a list of parts. `developer` is OpenAI's newer
    name for `system`; assistant turns are earlier answers (multi-turn chats)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = Field(None, description="Participant names are not supported: 400.")


class MPICOptions(BaseModel):
    """The `mpic` extension object of a chat request."""

    model_config = ConfigDict(extra="forbid", strict=True)
    policy: str = Field(
        "auto",
        min_length=1,
        description="Token-selection policy (linker registry name); `auto`: the best selection "
        "for `recompute_budget` (absent: the server's default policy).",
    )
    recompute_budget: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Recompute budget as a fraction of the prompt's tokens, in [0, 1]: served "
        "by the best selection for it (policy `auto`; with another policy: 400).",
    )
    press: str | None = Field(
        None,
        description="KV press applied after the linked prefill, before decoding "
        "(docs/presses.md): " + ", ".join(PRESS_NAMES) + "; absent: the server's default_press.",
    )
    budget: float | None = Field(
        None, gt=0, le=1, description="Fraction of the prompt's KV the press keeps, in (0, 1]."
    )
    exact_decode: bool | None = Field(
        None,
        description="Decode the tokens after the first over the prompt's exact KV: the first "
        "token comes from the policy's selective prefill (its time to first token), then the "
        "prompt is prefilled exactly once more and the answer is full prefill's given that "
        "token (docs/fidelity.md); with a press: 400. Absent: the server's default_exact_decode.",
    )

    @field_validator("press")
    @classmethod
    def _known_press(cls, value: str | None) -> str | None:
        if value is not None and value not in PRESS_NAMES:
            raise ValueError(f"unknown press {value!r}; known: {', '.join(PRESS_NAMES)}")
        return value

    retrieval: RetrievalSpec | Literal["auto"] | None = Field(
        None,
        description="MRAG over a dynamic-library collection (mpic.retriever.query), or "
        '"auto": the default collection in auto mode (linked only when close enough).',
    )


class StreamOptions(BaseModel):
    """OpenAI `stream_options`."""

    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class ResponseFormat(BaseModel):
    """OpenAI `response_format`: only plain text is served."""

    model_config = ConfigDict(extra="allow")
    type: str


REJECTED_FIELDS: dict[str, str] = {
    "tools": "tool calling is not supported",
    "tool_choice": "tool calling is not supported",
    "parallel_tool_calls": "tool calling is not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "the served model is not a reasoning model",
    "web_search_options": "web search is not supported",
    "metadata": "stored completions are not supported (metadata needs store)",
    "verbosity": "verbosity is not supported",
    "prompt_cache_key": "MPIC caches by content (upload files instead)",
    "safety_identifier": "safety identifiers are not supported",
}
"""OpenAI chat fields MPIC does not implement: any value other than null gets a 400 naming the
field (docs/serving.md has the table of every field)."""


class ChatCompletionRequest(VllmSamplingFields):
    """`POST /v1/chat/completions` body. Every OpenAI field is either honoured or, when set to
    something MPIC cannot do, rejected with a 400 naming it (`REJECTED_FIELDS`, `modalities`
    other than text, `response_format` other than text, `store: true`, and any field OpenAI
    does not define). Validation errors name the field in `error.param`."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str = Field(description="The served model id (`GET /v1/models`); others get 404.")
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=4096)
    max_completion_tokens: int | None = Field(None, ge=1, le=4096)
    temperature: float | None = Field(None, ge=0, le=2, description="0: greedy (default).")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling mass.")
    seed: int | None = Field(
        None, ge=-(2**63), lt=2**63, description="Same seed, same sampled text."
    )
    n: int = Field(1, ge=1, le=8, description="Choices to generate (streamed too).")
    stop: str | list[str] | None = Field(None, description="Up to 4 stop strings.")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100] added to its logit."
    )
    logprobs: bool | None = Field(None, description="Return the chosen tokens' logprobs.")
    ignore_eos: bool = Field(
        False,
        description="vLLM extension: decode max_tokens tokens past the model's end token "
        "(benchmarks); default: stop at it.",
    )
    top_logprobs: int | None = Field(None, ge=0, le=20, description="Alternatives per token.")
    add_generation_prompt: bool = Field(
        True,
        description="vLLM extension: end the prompt with the assistant's header (false: the "
        "chat template renders no header after the last message).",
    )
    continue_final_message: bool = Field(
        False,
        description="vLLM extension: the last message (an assistant's, else 400) is left open "
        "and the answer continues it; needs add_generation_prompt: false (else 400).",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="vLLM extension: extra variables of the chat template (e.g. "
        '{"enable_thinking": false}); the rendering\'s own arguments (add_generation_prompt, '
        "tokenize, chat_template, messages, tools, documents, ...): 400.",
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="End-user id: logged with the request id.")
    store: bool | None = Field(None, description="Only false/null: completions are not stored.")
    modalities: list[str] | None = Field(None, description='Only ["text"].')
    response_format: ResponseFormat | None = Field(None, description='Only {"type": "text"}.')
    service_tier: Literal["auto", "default"] | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    metadata: Any = None
    verbosity: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    mpic: MPICOptions | None = None

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        for name, why in REJECTED_FIELDS.items():
            if getattr(self, name) is not None:
                raise InvalidRequestError(f"{name}: {why}", param=name)
        if self.store:
            raise InvalidRequestError("store: completions are not stored", param="store")
        if self.modalities is not None and self.modalities != ["text"]:
            raise InvalidRequestError('modalities: only ["text"] is served', param="modalities")
        if self.response_format is not None and self.response_format.type != "text":
            raise InvalidRequestError(
                f"response_format {self.response_format.type!r} is not supported (only text)",
                param="response_format",
            )
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > 4 or any(not s for s in stops):
            raise InvalidRequestError("stop: at most 4 non-empty strings", param="stop")
        for i, message in enumerate(self.messages):
            if message.name is not None:
                raise InvalidRequestError(
                    "name: participant names are not supported (the chat template has no "
                    "place for them)",
                    param=f"messages.{i}.name",
                )
            for j, part in enumerate(message.content if isinstance(message.content, list) else []):
                detail = part.image_url.detail if isinstance(part, ImagePart) else None
                if detail not in (None, "auto"):
                    raise InvalidRequestError(
                        f"image_url.detail {detail!r}: images are encoded at the model's own "
                        'resolution (only "auto")',
                        param=f"messages.{i}.content.{j}.image_url.detail",
                    )
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError(
                "stream_options is only allowed when stream is true", param="stream_options"
            )
        check_logit_bias(self.logit_bias)
        check_final_message(self.template_options(), self.messages[-1].role)
        return self

    def template_options(self) -> ChatTemplateOptions | None:
        """How the chat template renders this request's prompt (vLLM's extensions,
        `mpic.linker.chat_template`); None: the default rendering. InvalidRequestError (naming
        the field) for vLLM's invalid combinations."""
        return template_options(
            self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs
        )

    def sampling(self) -> Sampling:
        """The engine-side `Sampling` of this request."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return Sampling(
            temperature=self.temperature or 0.0,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            stop=stops,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            ignore_eos=self.ignore_eos,
            **self.vllm_sampling(),
        )
