"""The flow of one request, the same for every engine (the process that plans and streams a
request: LLM-worker replica, benchmark, CLI): prompt parts -> link plan (`plan_parts`) -> items
swapped for their compressed entries when a press asks (`pressed_parts`) -> the backend's
`Engine.decode` (token ids) -> text cut at stop strings (`TextStream`) -> the closing
`DoneEvent` (`generate`: the finish reason by one rule, usage from the backend's `Prefill`,
`prefill_of`).

The backends implement only what differs (`mpic.engine.protocol.Engine.decode`): the reference
runner links and decodes in this process with `mpic.engine.sampling.Sampler`
(`mpic.engine.hf.engine`); vLLM turns the plan into its request
(`mpic.engine.vllm.frontend.VllmFrontEnd.prepare`) and samples natively
(`mpic.engine.vllm.async_engine`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, MutableMapping, Sequence
from typing import Any, Literal

import torch

from mpic.engine.detokenize import Detokenizer, StopMatcher
from mpic.engine.protocol import (
    Decoded,
    DoneEvent,
    Engine,
    GenerateRequest,
    Prefill,
    TokenEvent,
    TokenLogprob,
)
from mpic.engine.sampling import stop_ids
from mpic.errors import InvalidRequestError
from mpic.linker.chat_template import ChatTemplateOptions, templated
from mpic.linker.policies import Policy, get_policy
from mpic.linker.prompt import tokenizer_of
from mpic.linker.raw_prompt import RawPrompt
from mpic.linker.recipe import PlannedPrompt, plan_prompt
from mpic.model_spec import ModelSpec
from mpic.prompt_parts import DocumentRef, ImageRef, PromptPart
from mpic.types import CacheEntry, LinkPlan

INLINE_PREFIX = "inline-"
"""Entry ids of inline images (computed for one request, never from the store)."""


def plan_parts(
    spec: ModelSpec,
    processor: Any,
    parts: Sequence[PromptPart],
    entries: Mapping[str, CacheEntry],
    policy: Policy,
    system_prompt: str | None,
    max_new_tokens: int = 0,
    raw: bool = False,
    template: ChatTemplateOptions | None = None,
) -> PlannedPrompt:
    """The finished link plan of `parts` under `policy` (`mpic.linker.recipe.plan_prompt`; the
    backend parsed a name once, `policy_of`), rendered with the model's chat template (with the
    request's `template` options, `mpic.linker.chat_template`; None: the default rendering), or
    as given for a completion prompt (`raw`: `mpic.linker.raw_prompt`; `template` unused).
    Raises InvalidRequestError (bad parts, too long) or NotFoundError (an entry id not in
    `entries`) before any KV is touched."""
    renderer = RawPrompt(processor) if raw else templated(processor, template)
    return plan_prompt(spec, renderer, parts, entries, policy, system_prompt, max_new_tokens)


def policy_of(policy: str | Policy, scales: Sequence[Sequence[float]] | None = None) -> Policy:
    """A request's policy, parsed once where the request enters a backend: a name
    (`mpic.linker.policies.get_policy`, against the model's own scout `scales`) or a policy
    object as given (ValueError for a bad name, before any KV is touched)."""
    if isinstance(policy, str):
        return get_policy(policy, scales=scales)
    return policy


def reported_policy(policy: str | Policy) -> str:
    """The name a request's `DoneEvent` reports: a name as the request gave it, else the
    policy's own (canonical) name."""
    return policy if isinstance(policy, str) else policy.name


def pressed_parts(
    parts: Sequence[PromptPart],
    table: MutableMapping[str, CacheEntry],
    press_one: Callable[[CacheEntry], CacheEntry],
    media: MutableMapping[str, Any] | None = None,
) -> list[PromptPart]:
    """`parts` with every image and document linked as its compressed entry
    (`press_one(entry)`, e.g. `Engine.press_entry` at a press and budget), which joins `table`
    (and inherits the item's `media`, for an exact fallback)."""
    out: list[PromptPart] = []
    for part in parts:
        if isinstance(part, ImageRef | DocumentRef):
            entry = press_one(table[part.entry_id])
            table[entry.entry_id] = entry
            if media is not None and part.entry_id in media:
                media[entry.entry_id] = media[part.entry_id]
            part = type(part)(entry.entry_id)
        out.append(part)
    return out


class TextStream:
    """Token ids -> the TokenEvents of one request: detokenized incrementally
    (`Detokenizer`: no broken characters) and cut at the request's stop strings
    (`StopMatcher`: the stop string and what follows are dropped, unless `include_stop`),
    which are looked for in the text after the first `min_tokens` tokens only (vLLM's rule for
    `min_tokens`; a stop string that begins in that text is not cut), or at a stop token
    (`stop_ids`, vLLM's `stop_token_ids` and the end ids: the answer ends with it, counted, its
    text dropped unless `include_stop`). `skip_special` and `special_spaces`: the decode options
    (vLLM's `skip_special_tokens`, `spaces_between_special_tokens`: `Detokenizer`). `push` per
    decoded batch of tokens, `flush` once at the end; `stopped` tells whether a stop string or
    a stop token ended it."""

    def __init__(
        self,
        tokenizer: Any,
        stop: list[str],
        min_tokens: int = 0,
        stop_ids: Iterable[int] = (),
        include_stop: bool = False,
        skip_special: bool = True,
        special_spaces: bool | None = None,
    ) -> None:
        self.detok, self.stopped = Detokenizer(tokenizer, skip_special, special_spaces), False
        self.stops = StopMatcher(stop, include_stop)
        self.min_tokens, self.stop_ids, self.include_stop = min_tokens, set(stop_ids), include_stop

    @property
    def tokens(self) -> list[int]:
        """Every token id pushed so far."""
        return self.detok.tokens

    def push(self, tokens: Iterable[int], logprobs: list[TokenLogprob] | None = None) -> TokenEvent:
        """The event of newly decoded `tokens` (its text may be empty: held back)."""
        tokens, before = list(tokens), ""
        end = next((i for i, t in enumerate(tokens) if t in self.stop_ids), None)
        if end is not None:  # what follows a stop token is not part of the answer
            tokens, last = tokens[:end], tokens[end]
            logprobs = logprobs[: end + 1] if logprobs is not None else None
        while tokens and len(self.detok.tokens) < self.min_tokens:  # no stop string looked for
            before += self.detok.push(tokens[:1]).text
            tokens = tokens[1:]
        text, self.stopped = self.stops.push(self.detok.push(tokens).text if tokens else "")
        if end is not None and not self.stopped:  # the stop token ends it: the held text out
            text += self.stops.push(self.detok.flush().text)[0] + self.stops.flush()
            if self.include_stop:
                text += self.detok.push([last]).text + self.detok.flush().text
            else:
                self.detok.tokens.append(last)  # counted, not said
            self.stopped = True
        return TokenEvent(before + text, logprobs)

    def flush(self) -> TokenEvent | None:
        """The text held back at the end (None when there is none or a stop ended it)."""
        if self.stopped:
            return None
        rest = self.stops.push(self.detok.flush().text)[0] + self.stops.flush()
        return TokenEvent(rest) if rest else None


def finish_reason(stopped: bool, length: bool) -> Literal["stop", "length"]:
    """OpenAI's finish reason, vLLM's rule for both engines: "stop" at a stop string or an end
    id, "length" when decoding ran to `max_tokens` (`length`)."""
    return "length" if length and not stopped else "stop"


def stored_linked_tokens(plan: LinkPlan) -> int:
    """Prompt tokens served from STORED entries at every layer (recompute depth 0; inline images
    excluded). Tokens a policy recomputes at some layers (VLCache's partial depths, CacheBlend's
    check layers) ran through the model and do not count."""
    stored = torch.tensor([not e.startswith(INLINE_PREFIX) for e in plan.entry_ids] + [False])
    return int(((plan.recompute_depth == 0) & stored[plan.source_entry]).sum())


def prefill_of(
    plan: LinkPlan,
    ttft_s: float,
    fell_back: bool = False,
    first_token: Any = None,
    recomputed: int | None = None,
) -> Prefill:
    """The `Prefill` of a request planned as `plan`: its prompt tokens and the linked tokens
    served from stored entries (none when the request `fell_back` to exact recomputation,
    which then recomputed every entry of the plan); `recomputed`: the backend's count of the
    tokens its pass ran (`Prefill.recomputed_tokens`)."""
    return Prefill(
        prompt_tokens=plan.num_tokens,
        cached_tokens=0 if fell_back else stored_linked_tokens(plan),
        ttft_s=ttft_s,
        fallbacks=len(set(plan.entry_ids)) if fell_back else 0,
        first_token=first_token,
        recomputed_tokens=recomputed,
    )


def exact_policy(policy: str | Policy) -> bool:
    """True for `full` (every token recomputed: its KV is already the exact one)."""
    return (policy if isinstance(policy, str) else policy.name).strip() == "full"


def continued(request: GenerateRequest) -> list[int]:
    """`request.continue_from`, checked: a continuation is prefilled exactly, so its policy
    must be `full` (ValueError otherwise: the backends would prefill it differently)."""
    if request.continue_from and not exact_policy(request.policy):
        raise ValueError("a continuation (continue_from) is prefilled under the full policy only")
    return list(request.continue_from)


def check_sampling(spec: ModelSpec, request: GenerateRequest) -> None:
    """InvalidRequestError for sampling fields the model or the request's length cannot take:
    `min_tokens` above `max_tokens` (vLLM's rule), a `stop_token_ids` id outside the
    vocabulary."""
    s = request.sampling
    if s.min_tokens > request.max_tokens:
        raise InvalidRequestError(
            f"min_tokens ({s.min_tokens}) is more than max_tokens ({request.max_tokens})",
            param="min_tokens",
        )
    if not s.stop_token_ids:
        return
    vocab = spec.vocab_size or float("inf")  # 0: an open vocabulary (the fake engine's words)
    outside = [i for i in s.stop_token_ids if not 0 <= i < vocab]
    if outside:
        raise InvalidRequestError(
            f"stop_token_ids: {outside[0]} is outside the vocabulary ({spec.vocab_size} tokens)",
            param="stop_token_ids",
        )


async def decode_steps(engine: Engine, request: GenerateRequest) -> AsyncIterator[Decoded]:
    """`engine.decode(request)`, or with `request.exact_decode` two passes: the first token
    from the request's policy (its `Prefill`: TTFT, cached tokens, captured distribution), then
    the rest decoded by `full` over the prompt and that token (`continue_from`), i.e. over the
    prompt's exact KV: the answer is full prefill's whenever the first token is. Sampling runs
    in both passes with the request's settings (a seed restarts in the second: seeded answers
    stay reproducible, not equal to a one-pass run). Measured: docs/fidelity.md "Exact
    decoding"."""
    check_sampling(engine.spec, request)
    two_pass = request.exact_decode and request.max_tokens > 1 and not exact_policy(request.policy)
    head: list[int] = []
    # the first pass is the whole request (planned, checked and given room as one pass would
    # be), closed once its first token is out when a second pass follows
    steps = engine.decode(request)
    try:
        async for step in steps:
            if two_pass and step.token_ids:  # only the FIRST token is the first pass's: a
                # backend may hand several in one step (vLLM coalesces when its reader lags)
                logprobs = step.logprobs[:1] if step.logprobs is not None else None
                captured = step.captured[:1] if step.captured is not None else None
                step = Decoded(step.token_ids[:1], logprobs, step.prefill, captured)
            head.extend(step.token_ids)
            yield step
            if two_pass and head:
                break
    finally:
        await steps.aclose()
    if not two_pass:
        return
    ended = bool(head) and head[-1] in engine.spec.end_token_ids
    if not head or len(head) >= request.max_tokens or (ended and not request.sampling.ignore_eos):
        return
    rest = dataclasses.replace(
        request,
        policy="full",
        exact_decode=False,
        continue_from=[*request.continue_from, *head],
        forced_ids=request.forced_ids[len(head) :],
        max_tokens=request.max_tokens - len(head),
        sampling=dataclasses.replace(
            request.sampling, min_tokens=max(request.sampling.min_tokens - len(head), 0)
        ),
        capture_first_token=False,
        press=None,  # the exact KV: the items whole
        budget=None,
    )
    steps = engine.decode(rest)
    try:
        async for step in steps:
            # the first pass's Prefill stands
            yield Decoded(step.token_ids, step.logprobs, captured=step.captured)
    finally:
        await steps.aclose()


async def generate(
    engine: Engine, request: GenerateRequest
) -> AsyncIterator[TokenEvent | DoneEvent]:
    """The one flow of a generation over any backend's `Engine.decode`: the decoded ids ->
    text pieces (`TextStream`: incremental, cut at `request.sampling.stop`, which ends the
    generation and aborts the backend's work, or at a stop token: `stop_token_ids` and, unless
    `ignore_eos`, the end ids, vLLM's rule: counted, their text left out unless
    `include_stop_str_in_output`), then one `DoneEvent` with the finish reason
    (`finish_reason`: "length" when `max_tokens` ran out before an end id or a stop string)
    and the backend's `Prefill`. A generation abandoned before its first token ends with no
    DoneEvent (nobody waits for one)."""
    s = request.sampling
    text = TextStream(
        tokenizer_of(engine.processor),
        s.stop,
        s.min_tokens,
        stop_ids(s.stop_token_ids, engine.spec.end_token_ids, s.ignore_eos),
        s.include_stop_str_in_output,
        s.skip_special_tokens,
        s.spaces_between_special_tokens,
    )
    prefill: Prefill | None = None
    steps = decode_steps(engine, request)
    try:
        async for step in steps:
            prefill = step.prefill or prefill
            if step.token_ids:
                yield text.push(step.token_ids, step.logprobs)
            if text.stopped:
                break
    finally:
        await steps.aclose()  # a stop string or a consumer gone: the backend stops
    if (rest := text.flush()) is not None:
        yield rest
    if prefill is None:
        return
    tokens = text.tokens
    if prefill.first_token is not None:  # a captured pass: the monitor compares its answer too
        prefill.first_token.answer = list(tokens)
    ended = bool(tokens) and tokens[-1] in engine.spec.end_token_ids
    length = len(tokens) >= request.max_tokens and not (ended and not request.sampling.ignore_eos)
    yield DoneEvent(
        prompt_tokens=prefill.prompt_tokens,
        cached_tokens=prefill.cached_tokens,
        completion_tokens=len(tokens),
        finish_reason=finish_reason(text.stopped, length),
        ttft_s=prefill.ttft_s,
        fallbacks=prefill.fallbacks,
        policy=reported_policy(request.policy),
        first_token=prefill.first_token,
    )


class EngineBase(Engine):
    """The base of every backend: subclass it, write `decode` and the other `Engine` members,
    and `generate` is the one flow above."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | DoneEvent]:
        """`generate(self, request)`: the whole generation over this backend's `decode`."""
        return generate(self, request)


async def decoded_ids(
    engine: Engine,
    request: GenerateRequest,
    captured: list[Any] | None = None,
    stamps: list[float] | None = None,
) -> tuple[list[int], Prefill]:
    """Every token id `engine.decode` gives `request`, and its `Prefill` (benchmarks, tests:
    no text, no stop strings); `captured`, when given, collects each token's distribution
    (`Decoded.captured`, `GenerateRequest.capture_steps`), `stamps` the `time.perf_counter()`
    at which each step arrived."""
    ids: list[int] = []
    prefill: Prefill | None = None
    async for step in decode_steps(engine, request):
        if stamps is not None:
            stamps.append(time.perf_counter())
        ids.extend(step.token_ids)
        prefill = step.prefill or prefill
        if captured is not None:
            captured.extend(step.captured or [])
    assert prefill is not None, "a decode ended without its prefill"
    return ids, prefill
