"""Messages between the Serve deployments (Ingress, Resolver, Encoder, LLM worker; any replica).

Torch-free, so the HTTP ingress can import them without loading torch: an `EncodedImage` carries
a tensor from the Encoder to the LLM worker, but only its type is named here. The Resolver hands
the worker a `LinkedPrompt` (chat turns with every file reference resolved to a content-addressed
entry id in the caller's namespace); the worker streams `TokenEvent`s, then one `DoneEvent`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch


@dataclass
class Segment:
    """One piece of a turn: text, a cached entry (linked), or an inline image (recomputed)."""

    kind: Literal["text", "entry", "inline"]
    text: str = ""
    entry_id: str = ""
    """`entry` only: the content-addressed entry id."""
    content_hash: str = ""
    """`entry` only: sha256 of the media, to recompute the entry if it is lost (a fallback)."""
    file_id: str = ""
    """`entry` from a file part: the caller's file id (logged when the entry falls back)."""
    document: bool = False
    """`entry` only: the item is a text document (an uploaded .txt/.md file), not an image."""
    embeds: Any = None
    """`inline` only: the `EncodedImage` (a Ray ObjectRef in transit)."""


@dataclass
class LinkedTurn:
    """One chat message after resolution."""

    role: str
    segments: list[Segment]


@dataclass
class Sampling:
    """How to pick tokens (OpenAI's sampling fields, validated by the ingress); every engine
    honours all of them. temperature 0 is greedy; `seed` makes sampling reproducible."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    """Strings that end the answer; the matched stop string is not part of it."""
    logprobs: int | None = None
    """None: no logprobs; k >= 0: the chosen token's logprob and the k most likely."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Token id -> bias added to its logit before sampling (OpenAI `logit_bias`)."""
    ignore_eos: bool = False
    """Decode past the model's end token up to `max_tokens` (vLLM's option; benchmarks)."""


@dataclass
class LinkedPrompt:
    """What the worker generates from: resolved turns, policy, decoding budget."""

    turns: list[LinkedTurn]
    policy: str
    max_tokens: int
    retrieved: list[str] = field(default_factory=list)
    """Entry ids the retriever added (reported back to the client)."""
    sampling: Sampling = field(default_factory=Sampling)
    request_id: str = ""
    """The ingress's request id (logged by every deployment that handles the request)."""
    press: str | None = None
    """KV press applied after the prefill (`mpic.presses`), None for none."""
    budget: float | None = None
    """The press's budget, a fraction of the prompt's KV in (0, 1]."""
    raw: bool = False
    """A completion prompt (`/v1/completions`): rendered without the chat template
    (`mpic.linker.raw_prompt`); text and documents only."""
    policy_defaulted: bool = False
    """The request named neither a policy nor a recompute budget: the server's default applies
    (the fidelity loop may move it, `mpic.deployments.monitoring.fidelity_monitor`)."""
    capture_first_token: bool = False
    """Set by the LLM worker for a request sampled by the fidelity monitor: the engine returns
    the served pass's first-token distribution in `DoneEvent.first_token`."""

    @property
    def entry_ids(self) -> list[str]:
        """Every linked entry id, in prompt order (repeats kept)."""
        return [s.entry_id for t in self.turns for s in t.segments if s.kind == "entry"]


@dataclass
class EncodedImage:
    """Encoder output: the bytes, content hash and input embeddings of one image."""

    media: bytes
    """The image file as uploaded (engines that encode inside `compute_entry` need it)."""
    content_hash: str
    """sha256 hex of the media bytes."""
    media_type: str
    """MIME type detected from the bytes, e.g. image/png."""
    input_embeds: torch.Tensor | None
    """[T, hidden]; None for engines that encode inside `compute_entry` (vLLM)."""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class TokenLogprob:
    """One generated token with its logprob and the most likely alternatives."""

    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)
    raw: bytes | None = None
    """The token's own bytes (`mpic.deployments.token_bytes`; a byte token of a multi-byte
    character is that one byte, not U+FFFD's three); None: the UTF-8 of `token`."""
    top_raw: list[bytes] | None = None
    """The bytes of each alternative in `top`, in order; None: the UTF-8 of their text."""


@dataclass
class TokenEvent:
    """A piece of generated text (and, when asked for, the logprobs of its tokens)."""

    text: str
    logprobs: list[TokenLogprob] | None = None


@dataclass
class DoneEvent:
    """The end of a generation, with what the ingress reports and records as metrics."""

    prompt_tokens: int
    cached_tokens: int
    """Linked (reused) tokens: OpenAI's `usage.prompt_tokens_details.cached_tokens`."""
    completion_tokens: int
    finish_reason: Literal["stop", "length"]
    ttft_s: float
    """Engine-side time to first token (link plan + loads + prefill + first decode)."""
    tier_hits: dict[str, int] = field(default_factory=dict)
    """Entries served per storage tier, e.g. {"memory": 2, "disk": 1}."""
    fallbacks: int = 0
    """Entries that were missing or corrupt and were recomputed instead."""
    policy: str = ""
    """The policy the worker served (the fidelity loop may replace the default); "" unknown."""
    first_token: Any = None
    """Only inside the LLM worker, when `capture_first_token` was set: the served pass's
    `mpic.deployments.monitoring.fidelity_monitor.FirstToken` (the worker strips it)."""
