"""The one engine protocol both backends implement (any process that owns an engine: CLI,
benchmark, Serve replica), and the torch-free vocabulary of a generation: how to pick tokens
(`Sampling`) and what a generation streams (`TokenEvent`s, then one `DoneEvent`).

Two backends implement `Engine` once each: the HF reference runner
(`mpic.engine.hf.reference_runner.ReferenceRunner`) and vLLM with the MPIC connector
(`mpic.engine.vllm.frontend.VllmFrontEnd`, driven offline by `VllmEngine` and asynchronously by
`AsyncVllmEngine`). Everything around them is a thin adapter: the Serve engines
(`mpic.deployments.engines.reference_engine`, `mpic.deployments.engines.vllm_serve_engine`), the
offline benchmark's engines (`mpic.benchmarks.engines`, `mpic.benchmarks.vllm_engine`) and the
compression benchmarks (`mpic.benchmarks.compress`, `mpic.benchmarks.compress_vllm`). The
steps of a request that do not depend on the backend (parts -> plan, compressed items, tokens ->
text with stop strings, the finish reason, the cached-token count) are written once in
`mpic.engine.request_flow`; sampling in `mpic.engine.sampling`; detokenizing in
`mpic.engine.detokenize`; image and document items in `mpic.engine.items`.

Torch-free (dataclasses and a Protocol), so the HTTP ingress imports the vocabulary through
`mpic.deployments.messages` without loading torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from mpic.linker.recipe import PlannedPrompt
    from mpic.model_spec import ModelSpec
    from mpic.prompt_parts import PromptPart
    from mpic.types import CacheEntry


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
class TokenLogprob:
    """One generated token with its logprob and the most likely alternatives."""

    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)
    raw: bytes | None = None
    """The token's own bytes (`mpic.engine.token_bytes`; a byte token of a multi-byte
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


@runtime_checkable
class Engine(Protocol):
    """What a backend offers, implemented once per backend: the model (`spec`, `processor`),
    items cached as entries in the canonical context, compressed entries, and the link plan of
    a prompt. Generation streams token ids from a plan; the text around them (sampling for the
    reference runner, stop strings, detokenizing, the finish reason) is `mpic.engine
    .request_flow`'s, the same for both backends.

    `press_entry` takes and returns `CacheEntry`s on both backends; `system_prompt=None` means
    the engine's own (the reference runner's configured one; none for vLLM)."""

    spec: ModelSpec
    """The served model's shapes, family, special ids and fingerprint."""

    @property
    def processor(self) -> Any:
        """The model's HF processor (chat template + tokenizer; the tokenizer of a text-only
        model)."""
        ...

    def cache_image(self, media: bytes, system_prompt: str | None = None) -> CacheEntry:
        """The entry of an image (its KV after the canonical context), named by its content
        address; UnreadableMediaError (415) when the bytes are not an image."""
        ...

    def cache_document(self, text: str, system_prompt: str | None = None) -> CacheEntry:
        """The entry of a text document (its own token ids after its canonical context)."""
        ...

    def press_entry(self, entry: CacheEntry, press: str, budget: float) -> CacheEntry:
        """`entry` compressed by `press` at `budget` (the presses' uniform-across-layers
        variant, `mpic.presses.entries`); budget 1.0 gives `entry` itself."""
        ...

    def plan(
        self,
        parts: Sequence[PromptPart],
        policy: Any = "full",
        max_new_tokens: int = 0,
        system_prompt: str | None = None,
        *,
        entries: Mapping[str, CacheEntry] | None = None,
        raw: bool = False,
    ) -> PlannedPrompt:
        """The finished link plan of `parts` under `policy` over `entries`
        (`mpic.engine.request_flow.plan_parts`); `raw`: a completion prompt (no chat
        template)."""
        ...
