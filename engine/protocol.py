"""The one engine protocol every backend implements (any process that owns an engine: CLI,
benchmark, Serve replica), and the torch-free vocabulary of a generation: what to generate
(`GenerateRequest`), how to pick tokens (`Sampling`), what a backend decodes (`Decoded` steps,
the first carrying its `Prefill`) and what a generation streams (`TokenEvent`s, then one
`DoneEvent`).

Three backends implement `Engine` once each: the HF reference runner
(`mpic.engine.hf.engine.ReferenceEngine` over `mpic.engine.hf.reference_runner
.ReferenceRunner`), vLLM with the MPIC connector (`mpic.engine.vllm.async_engine
.AsyncVllmEngine`; its offline sibling `VllmEngine` shares `mpic.engine.vllm.frontend
.VllmFrontEnd`) and the model-free fake (`mpic.deployments.engines.fake_engine.FakeEngine`).
Each writes `decode` (token ids as they are decoded); `generate`, the whole generation, is
written once (`mpic.engine.request_flow.generate`) and inherited from
`mpic.engine.request_flow.EngineBase`. Everything around them drives this protocol: the Serve
engines are thin adapters (`mpic.deployments.engines.engine.ServeEngine`), the offline benchmark
drives any `Engine` directly (`mpic.benchmarks.offline.engines`: a factory by name and the
benchmark's requests, `Driver`), and so do the compression benchmark on both of its engines
(`mpic.benchmarks.compress.rows.CompressBench`), the fidelity benchmark
(`mpic.benchmarks.fidelity.answers.Answers`) and `mpic demo --offline`'s answer table
(`mpic.cli.demo_answers`).

Torch-free (dataclasses and a Protocol), so the HTTP ingress imports the vocabulary through
`mpic.deployments.messages` without loading torch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from mpic.linker.chat_template import ChatTemplateOptions
    from mpic.linker.policies import Policy
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
    top_k: int = 0
    """vLLM's: sample among the k most likely tokens only (0 or -1: all)."""
    min_p: float = 0.0
    """vLLM's: drop tokens whose probability is below min_p x the most likely one's."""
    repetition_penalty: float = 1.0
    """vLLM's (CTRL's): the logit of every token in the prompt or generated so far is divided
    by it where positive, multiplied where negative (1: none)."""
    min_tokens: int = 0
    """vLLM's: the end ids (`ModelSpec.end_token_ids`) and `stop_token_ids` cannot be picked,
    and stop strings are not looked for, until this many tokens are generated."""
    stop_token_ids: list[int] = field(default_factory=list)
    """vLLM's: ids that end the answer (with `ignore_eos` too); the id is counted, its text is
    not part of the answer (unless `include_stop_str_in_output`)."""
    include_stop_str_in_output: bool = False
    """vLLM's: keep the matched stop string (or the stop token's text) in the answer."""
    skip_special_tokens: bool = True
    """vLLM's: leave special tokens out of the text (an end token's text is left out unless
    `include_stop_str_in_output`)."""
    spaces_between_special_tokens: bool | None = None
    """vLLM's (default True): spaces between special tokens and the text around them, for
    tokenizers whose decode takes the option (HF fast tokenizers add none either way); None:
    the tokenizer's own default."""


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
    `mpic.engine.first_token.FirstToken` (the worker strips it)."""


@dataclass
class GenerateRequest:
    """One generation as every engine takes it: prompt parts over the entries they link, the
    policy that selects what is recomputed, and how to decode."""

    parts: Sequence[PromptPart]
    entries: Mapping[str, CacheEntry]
    """Every entry `parts` links (by id): linkable for this request only."""
    policy: str | Policy = "full"
    """A policy name (the backend parses it once, against its model's scout scales) or a parsed
    policy (the Serve worker's, from the Resolver replica: taken as given)."""
    sampling: Sampling = field(default_factory=Sampling)
    max_tokens: int = 16
    system_prompt: str | None = None
    """This request's system prompt; None: the engine's own."""
    raw: bool = False
    """A completion prompt (no chat template, `mpic.linker.raw_prompt`)."""
    template: ChatTemplateOptions | None = None
    """How the chat template renders the prompt (vLLM's `add_generation_prompt`,
    `continue_final_message`, `chat_template_kwargs`: `mpic.linker.chat_template`); None: the
    default rendering (the assistant's header at the end). Unused for a `raw` prompt."""
    press: str | None = None
    """Compress the linked items' KV by this press (`mpic.presses`) at `budget`."""
    budget: float | None = None
    media: Mapping[str, bytes | Callable[[], bytes]] | None = None
    """Entry id -> its item's bytes (or a reader of them): what an exact fallback recomputes
    when a linked entry cannot be loaded (vLLM); None: no fallback."""
    capture_first_token: bool = False
    """Report the served pass's first-token distribution in `Prefill.first_token`."""
    request_id: str = ""
    exact_decode: bool = False
    """Decode over the prompt's EXACT KV: the policy's pass gives the first token (and the
    time to it), then the prompt and that token are prefilled under `full` and decoding goes
    on from there (`mpic.engine.request_flow.decode_steps`): the answer is full prefill's
    given the first token, at the cost of one full prefill per request after the first token."""
    continue_from: Sequence[int] = ()
    """Token ids already generated for this prompt: prefilled after it (exactly: the policy
    must be `full`), not yielded again; decoding yields what follows them, `max_tokens` more."""
    plain: bool = False
    """Run an exact policy (`full`, `prefix`) as the backend's own plain request instead of a
    linked pass: vLLM prefills the prompt from its items' `media` (the vision tower included;
    `media` must hold every image) under its own prefix caching (`cache_salt` says what may
    hit), and InvalidRequestError for another policy; backends with no other path (the
    reference runner, the fake engine) ignore it. The offline benchmark's vLLM `full` and
    `prefix` baselines (docs/vllm.md "Benchmark")."""
    cache_salt: str | None = None
    """The salt of the backend's own prefix cache, on backends that keep one across requests
    (`prefix_cache`, vLLM's: blocks are shared only under equal salts, so a fresh salt means no
    reuse); None: the backend's default (vLLM: none for a plain request, the plan's for a
    linked one). Backends without one ignore it."""
    capture_top_k: int | None = None
    """With `capture_first_token`, on a backend that reports log-probs rather than logits
    (vLLM): how many of the most likely first tokens it captures; None:
    `mpic.engine.first_token.TOP_K`; -1: the whole vocabulary (the engine must allow it: vLLM's
    `max_logprobs=-1`). Backends with logits capture them all."""
    capture_steps: bool = False
    """Report every decoded token's distribution (`Decoded.captured`), as `capture_first_token`
    reports the first's (vLLM: of `capture_top_k`'s tokens; the reference engine: the logits);
    the fake engine captures none. The compression benchmark's per-step KL."""
    forced_ids: Sequence[int] = ()
    """Teacher forcing: decoding takes these ids, in order, in place of its own picks (each still
    yielded, captured by `capture_steps` with the distribution it replaced, its logprob and
    penalties counted), then picks its own. The reference engine; vLLM and the fake engine
    cannot (InvalidRequestError). The compression benchmark's teacher-forced KL."""


@dataclass
class Prefill:
    """What a backend reports once a request's first token is out."""

    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens served from stored entries (`mpic.engine.request_flow.prefill_of`)."""
    ttft_s: float
    fallbacks: int = 0
    """Entries the backend recomputed exactly (a linked entry that could not load)."""
    first_token: Any = None
    """The `mpic.engine.first_token.FirstToken` when `capture_first_token` was asked."""
    recomputed_tokens: int | None = None
    """Prompt tokens the pass ran through at least one layer (over both steps of a two-step
    policy); the others were linked from entries or hit a prefix cache. None: the backend does
    not tell (read `prompt_tokens - cached_tokens`)."""
    kv_bytes: int | None = None
    """Bytes of KV storage the backend holds for the request while it decodes (the reference
    engine: its dense or compressed KV, room for `max_tokens` included). None: the backend does
    not tell (vLLM: its paged blocks are shared)."""
    scout: Any = None
    """The scouting pass's cost under a `scout-*` policy (`mpic.linker.scout.ScoutReport`:
    `layers_run`, `tokens`); None: no scouting pass, or the backend does not tell (vLLM). The
    reference engine; the fidelity benchmark's scout columns."""


@dataclass
class Decoded:
    """A backend's step of a generation: token ids decoded since the last step."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    """One per token of `token_ids` when the request asked for logprobs."""
    prefill: Prefill | None = None
    """Set on the first step (the first token's)."""
    captured: list[Any] | None = None
    """With `GenerateRequest.capture_steps`: per token of `token_ids`, the distribution it was
    picked from (a `mpic.engine.first_token.FirstToken`); None when not captured."""


@runtime_checkable
class Engine(Protocol):
    """What a backend offers, implemented once per backend: the model (`spec`, `processor`),
    items cached as entries in the canonical context, compressed entries, the link plan of a
    prompt, and `decode`, the backend's half of a generation (token ids as they are decoded).
    `generate`, the whole generation as `TokenEvent`s and a `DoneEvent`, is written once over
    `decode` (`mpic.engine.request_flow.generate`: stop strings, detokenizing, the finish
    reason, usage): a backend subclasses `mpic.engine.request_flow.EngineBase` and inherits
    it.

    `press_entry` takes and returns `CacheEntry`s on both backends; `system_prompt=None` means
    the engine's own (the reference runner's configured one; none for vLLM).

    Optional members (timing hooks and the like), read with getattr by the tools that use them
    (the offline benchmark, `mpic.benchmarks.offline`; the fidelity benchmark,
    `mpic.benchmarks.fidelity`; absent, the tool does without or refuses the option):
    - `floor_s(num_tokens, repeats) -> float`: median seconds of a plain forward of that many
      text tokens (the benchmark's floor column); the reference engine;
    - `prefill_fn(request) -> Callable[[], object]`: a zero-argument callable running
      `request`'s first-token prefill in this process, untimed (op counts, GPU profile); only
      a backend whose model runs in this process (the reference engine);
    - `num_layers: int`: the model's decoder layers (ops per layer); the reference engine;
    - `device: str`: where the model runs in this process ("cpu" when absent; "cuda" gets two
      warm-ups); the reference engine;
    - `worker_cpu_s() -> float`: CPU seconds used so far by the processes the model runs in
      outside this one (vLLM's workers): a tool adds their share to this process's CPU time;
    - `prefix_cache: bool`: the backend keeps its own prefix cache across requests (vLLM): a
      tool timing repeats of one prompt salts them (`GenerateRequest.cache_salt`) or varies
      their opening text;
    - `close()`: stop the backend's processes (vLLM);
    - `layer_adapter`: the model's layer step (`mpic.engine.hf.adapters.HFLayerAdapter`) that a
      calibration prefills its proxy prompts through (VLCache's,
      `mpic.benchmarks.fidelity.prompts.calibrate_vlcache_on_documents`); the reference engine;
    - `variant(model_dir, dtype=None, attention=None) -> Engine`: this engine computing another
      way, in another dtype (a second copy of the model) or with another attention backend
      (the weights shared); ValueError for its own (bit-identical). The fidelity benchmark's
      noise floors (`mpic.benchmarks.fidelity.noise_floor`); the reference engine."""

    spec: ModelSpec
    """The served model's shapes, family, special ids (`end_token_ids` end a generation) and
    fingerprint."""

    @property
    def processor(self) -> Any:
        """The model's HF processor (chat template + tokenizer; the tokenizer of a text-only
        model)."""
        ...

    def cache_image(self, media: bytes, system_prompt: str | None = None) -> CacheEntry:
        """The entry of an image (its KV after the canonical context), named by its content
        address; UnreadableMediaError (415) when the bytes are not an image. Blocks the
        calling thread."""
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
        template: ChatTemplateOptions | None = None,
    ) -> PlannedPrompt:
        """The finished link plan of `parts` under `policy` over `entries`
        (`mpic.engine.request_flow.plan_parts`); `raw`: a completion prompt (no chat
        template); `template`: the chat template's options (`GenerateRequest.template`)."""
        ...

    def decode(self, request: GenerateRequest) -> AsyncIterator[Decoded]:
        """Async generator: link and prefill `request` under its policy, then decode by its
        sampling (every `Sampling` field but `stop`, which `generate` applies), yielding the
        token ids decoded since the last step (an end id included), the first step carrying
        the `Prefill`; stops after an end id (`spec.end_token_ids`, unless `ignore_eos`) or
        `max_tokens`. Closing it stops the work (the request is aborted or never prefilled).
        Raises InvalidRequestError / NotFoundError for a bad request before any KV is touched.
        Must not block the event loop."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | DoneEvent]:
        """The whole generation: text pieces as they are decoded, cut at a stop string, then
        one `DoneEvent`; the same for every backend (`mpic.engine.request_flow.generate`, which
        a backend inherits from `mpic.engine.request_flow.EngineBase`)."""
        ...
