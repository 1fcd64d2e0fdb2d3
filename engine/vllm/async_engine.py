"""vLLM V1's async engine (`AsyncLLM`) with the MPIC connector: token streaming and continuous
batching of concurrent requests (the Ray Serve LLM worker's engine, `engine.kind: vllm`).

Runs in the process that owns the engine (a Serve replica); vLLM's engine core and worker are
child processes, exactly as for the offline `mpic.engine.vllm.engine.VllmEngine`, with which it
shares config, request forms, upload prompt and fallback (`mpic.engine.vllm.frontend
.VllmFrontEnd`), CPU set-up and engine arguments (`mpic.engine.vllm.startup`).

`AsyncLLM` lives on its own event loop in a daemon thread, so any caller can use it: `stream`
is an async generator usable from any other loop (a Serve replica's), every request a vLLM
request of its own that vLLM's scheduler batches with the others in flight; `cache_image` blocks
the calling thread (Serve runs sync methods on worker threads). A linked request that vLLM
finishes with an error (an entry its worker could not load, `kv_load_failure_policy="fail"`)
is detected as in the offline engine and answered by resubmitting its exact fallback
(logged, counted in `fallbacks`). A stat logger records the most requests vLLM's scheduler ran
in one step (`peak_running`), which shows batching at work.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from functools import partial
from typing import Any

from mpic.engine.first_token import TOP_K, FirstToken
from mpic.engine.protocol import Decoded, GenerateRequest
from mpic.engine.request_flow import (
    EngineBase,
    continued,
    prefill_of,
    pressed_parts,
    reported_policy,
)
from mpic.engine.token_bytes import TokenBytes
from mpic.engine.vllm.config import VllmEngineConfig
from mpic.engine.vllm.frontend import VllmFrontEnd
from mpic.engine.vllm.presses import check_press
from mpic.engine.vllm.requests import EngineRequest, EngineResult
from mpic.engine.vllm.sampling import sampling_kwargs, token_logprobs
from mpic.engine.vllm.startup import engine_kwargs
from mpic.errors import InvalidRequestError
from mpic.linker.pipeline import served_plan
from mpic.linker.prefix import prefix_length, takes_prefix
from mpic.linker.prompt import tokenizer_of
from mpic.linker.recipe import PlannedPrompt
from mpic.prompt_parts import DocumentRef, ImageRef, PromptPart
from mpic.types import CacheEntry, LinkPlan

_END = object()


def _peak_logger(engine: AsyncVllmEngine, vllm_config: Any, engine_index: int = 0) -> Any:
    """A vLLM per-engine stat logger that keeps the largest `num_running_reqs` seen."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class PeakRunning(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            if scheduler_stats is not None:
                engine.peak_running = max(engine.peak_running, scheduler_stats.num_running_reqs)

        def log_engine_initialized(self) -> None:
            pass

    return PeakRunning(vllm_config, engine_index)


class AsyncVllmEngine(VllmFrontEnd, EngineBase):
    """`AsyncLLM` + the MPIC connector: the vLLM backend of `Engine` (`decode`), generations
    batched across callers."""

    def __init__(self, cfg: VllmEngineConfig) -> None:
        super().__init__(cfg)
        self._token_bytes: TokenBytes | None = None
        self.peak_running = 0
        """Most requests vLLM's scheduler had running in one step (continuous batching)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="mpic-vllm-async", daemon=True
        )
        self._thread.start()
        self.llm = self._call(self._start())

    async def _start(self) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(**engine_kwargs(self.cfg))
        return AsyncLLM.from_engine_args(args, stat_loggers=[partial(_peak_logger, self)])

    def connector_stats(self) -> dict[str, int]:
        """The worker connector's linking counters (`link_passes`, `linked_requests`,
        `largest_pass`, `failed`)."""
        (stats,) = self._call(self.llm.collective_rpc("mpic_connector_stats"))
        return stats

    def _call(self, coro: Coroutine) -> Any:
        """Run `coro` on the engine's loop and wait for it (from any thread but that loop's)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def decode(self, request: GenerateRequest) -> AsyncIterator[Decoded]:
        """`Engine.decode`: the request's plan and linked vLLM request (`linked`, on a thread;
        plain vLLM for a `plain` one), then its tokens as vLLM emits them, sampled by vLLM
        (`request.sampling`, greedy by default); the first step carries the prefill (TTFT from
        this call to vLLM's first token, the tokens the pass ran: `recomputed_tokens`; its
        top-`TOP_K` raw logprobs, or `capture_top_k`'s, when `capture_first_token`: vLLM
        returns logprobs, not logits; every token's the same way in `captured` when
        `capture_steps`). A linked request that fails to link is answered by its exact fallback
        (`Prefill.fallbacks`). No teacher forcing (`forced_ids`: InvalidRequestError)."""
        if request.forced_ids:
            raise InvalidRequestError("the vLLM engine cannot teacher-force (forced_ids)")
        start = time.perf_counter()
        tokenizer = tokenizer_of(self.processor)
        sampling = sampling_kwargs(request.sampling, len(tokenizer))
        top_k = TOP_K if request.capture_top_k is None else request.capture_top_k
        if request.capture_first_token or request.capture_steps:  # top-k raw logprobs
            sampling["logprobs"] = -1 if top_k < 0 else max(sampling["logprobs"] or 0, top_k)
        planned, linked = await asyncio.to_thread(self.linked, request)
        plan = self.served(planned, linked)
        done = 0
        results = self.stream(linked, request.max_tokens, sampling)
        try:
            async for result in results:
                new = result.token_ids[done:]
                if not new:
                    continue
                steps = result.extra.get("logprobs") or []
                prefill = None
                if done == 0:
                    first = None
                    if request.capture_first_token and steps and not result.fell_back:
                        k = len(steps[0]) if top_k < 0 else top_k  # -1: every token
                        first = FirstToken.from_logprobs(steps[0], k)
                    ttft = time.perf_counter() - start
                    ran = recomputed_tokens(planned, plan, linked, result)
                    prefill = prefill_of(plan, ttft, result.fell_back, first, ran)
                captured = None
                if request.capture_steps:
                    mine = steps[done : done + len(new)]
                    captured = [
                        FirstToken.from_logprobs(s, len(s) if top_k < 0 else top_k) for s in mine
                    ]
                logprobs = None
                if (k := request.sampling.logprobs) is not None:
                    steps = steps[done : done + len(new)]
                    logprobs = token_logprobs(steps, new, k, tokenizer.decode, self._raw_bytes())
                done += len(new)
                yield Decoded(list(new), logprobs, prefill, captured)
        finally:
            await results.aclose()  # aborts the vLLM request when cut short

    def served(self, planned: PlannedPrompt, linked: EngineRequest) -> LinkPlan:
        """The plan the worker serves a linked request with, as this process can know it
        (`mpic.linker.pipeline.served_plan`: a scouting policy's picks counted, the cached
        prefix the worker links at depth 0), so `Prefill.cached_tokens` and
        `.recomputed_tokens` count what the reference engine counts; a plain request's plan
        as planned."""
        if linked.plan is None:
            return planned.plan
        layers = self.spec.num_layers
        prefix = 0
        if self.cfg.link_prefix and takes_prefix(planned.policy, planned.plan, layers):
            prefix = prefix_length(planned.plan, planned.entries)
        return served_plan(planned, layers, prefix)

    def linked(self, request: GenerateRequest) -> tuple[PlannedPrompt, EngineRequest]:
        """(plan, linked vLLM request: `prepare`) of `request`, its items swapped for their
        compressed entries when it names a press (`_pressed`); its exact fallback, built only if
        the link fails, reads `request.media`. A `plain` request (`full` or `prefix` only) is
        plain vLLM over the prompt and its images from `request.media`; `cache_salt` replaces
        the request's prefix-cache salt. Blocking (a press may run vLLM): call on a thread."""
        parts, table = list(request.parts), dict(request.entries)
        media = None if request.media is None else dict(request.media)
        if request.plain:
            _check_plain(request, parts, media)
        if request.press is not None:
            parts = self._pressed(parts, table, media, request.press, request.budget)
        continuation = continued(request)
        planned, linked = self.prepare(
            parts,
            table,
            request.policy,
            request.system_prompt,
            request.max_tokens + len(continuation),
            raw=request.raw,
            template=request.template,
            media=media,
            # plain vLLM for a plain request and for a continuation (over prompt + its tokens)
            exact=request.plain or bool(continuation),
            salt=request.cache_salt,
        )
        linked.prompt_token_ids = [*linked.prompt_token_ids, *continuation]
        return planned, linked

    def _pressed(
        self,
        parts: list[PromptPart],
        table: dict[str, CacheEntry],
        media: dict[str, bytes | Callable[[], bytes]] | None,
        press: str,
        budget: float | None,
    ) -> list[PromptPart]:
        """`parts` with every image and document linked as its compressed entry (the presses'
        uniform variant, `mpic.engine.vllm.presses`: made by vLLM's worker on first use of
        (entry, press, budget), then read from the store), so the prompt, vLLM's paged KV and
        decoding shrink. 400 (`mpic.press`) for an M-RoPE model and for a prompt without cached
        items (vLLM compresses only those: the press would be ignored there). The exact
        fallback of a failed link carries the images whole and the documents' kept tokens."""
        check_press(self.spec, press, budget)
        if not any(isinstance(p, ImageRef | DocumentRef) for p in parts):
            raise InvalidRequestError(
                "mpic.press: the vLLM engine compresses cached images and documents only (text "
                "is computed per request) and this prompt links none; use the reference engine "
                "to compress text",
                param="mpic.press",
            )
        return pressed_parts(
            parts, table, lambda e: self.press_entry(e, press, budget or 1.0), media
        )

    def _raw_bytes(self) -> TokenBytes:
        """The tokenizer's `TokenBytes` (logprob bytes), made on first use."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(tokenizer_of(self.processor))
        return self._token_bytes

    async def stream(
        self, req: EngineRequest, max_tokens: int = 8, sampling: dict[str, Any] | None = None
    ) -> AsyncIterator[EngineResult]:
        """Decode `req` (greedy, or by `sampling`: SamplingParams keywords), yielding the result
        so far (cumulative `token_ids`; `extra["logprobs"]`: vLLM's per-token logprob dicts when
        asked for) each time vLLM emits tokens; a linked request that fails to link is answered
        by its fallback (`fell_back` set). Closing the generator aborts the vLLM request."""
        caller = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def put(item: object) -> None:
            caller.call_soon_threadsafe(queue.put_nowait, item)

        async def pump() -> None:
            try:
                async for res in self._generate(req, max_tokens, sampling):
                    put(res)
                put(_END)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's loop
                put(exc)

        task = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := await queue.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            task.cancel()

    async def _generate(
        self, req: EngineRequest, max_tokens: int, params: dict[str, Any] | None = None
    ) -> AsyncIterator[EngineResult]:
        """On the engine's loop: one vLLM request; its exact fallback if it failed to link."""
        prompt, sampling = self._submit_form(req, max_tokens, False, params)
        async for out in self.llm.generate(prompt, sampling, request_id=uuid.uuid4().hex):
            completion = out.outputs[0]
            if self.link_failed(req, completion.finish_reason):
                (exact,) = await asyncio.to_thread(self._fallbacks, [req])  # may read media
                async for res in self._generate(exact, max_tokens, params):
                    res.fell_back = True
                    yield res
                return
            yield EngineResult(
                token_ids=list(completion.token_ids),
                num_cached_tokens=int(out.num_cached_tokens or 0),
                finish_reason=completion.finish_reason,
                extra={"logprobs": completion.logprobs} if completion.logprobs else {},
            )

    async def _run_entry(self, prompt: dict, sampling: Any) -> None:
        async for _ in self.llm.generate(prompt, sampling, request_id=uuid.uuid4().hex):
            pass

    def _run_to_end(self, prompt: dict, sampling: Any) -> None:
        """One request (an upload or a compression) on the engine's loop, batched with the
        requests in flight; blocks the calling thread until it ends."""
        self._call(self._run_entry(prompt, sampling))

    def close(self) -> None:
        """Stop vLLM's processes and the engine's loop. vLLM's `AsyncLLM.shutdown` stops its
        engine core before it cancels the task that reads the core's outputs, so that task
        meets the dead engine and logs it as an error (a traceback at every clean exit); that
        one record is dropped while the engine closes (requests still in flight get the error
        as before)."""
        handler_log = logging.getLogger("vllm.v1.engine.async_llm")
        quiet = _DropRecord("AsyncLLM output_handler failed")
        handler_log.addFilter(quiet)
        try:
            self.llm.shutdown()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        finally:
            handler_log.removeFilter(quiet)


class _DropRecord(logging.Filter):
    """Drops the log records whose message starts with `prefix`."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


PLAIN_POLICIES = ("full", "prefix")
"""The exact policies a `plain` request may name (vLLM's own baselines)."""


def _check_plain(
    request: GenerateRequest, parts: list[PromptPart], media: dict[str, Any] | None
) -> None:
    """InvalidRequestError unless a `plain` request names an exact policy and carries the
    media of every image it links (plain vLLM prefills them)."""
    if reported_policy(request.policy).strip() not in PLAIN_POLICIES:
        raise InvalidRequestError(
            f"a plain request runs {' or '.join(PLAIN_POLICIES)}, not {request.policy!r}"
        )
    images = [p.entry_id for p in parts if isinstance(p, ImageRef)]
    if missing := [i for i in images if i not in (media or {})]:
        raise InvalidRequestError(f"a plain request needs the media of its images {missing}")


def recomputed_tokens(
    planned: PlannedPrompt, plan: LinkPlan, req: EngineRequest, result: EngineResult
) -> int:
    """Prompt tokens a vLLM pass ran through at least one layer (`Prefill.recomputed_tokens`):
    a linked request's by the plan it is served with (`AsyncVllmEngine.served`: recompute depth
    > 0; the text too for a two-step policy, whose second pass reruns it), a plain request's
    (or a fallback's) the prompt less vLLM's own prefix-cache hits. A linked request may also
    hit vLLM's cache on a repeat (its salted blocks), but the connector relinks the whole prompt
    every time: not subtracted."""
    if req.plan is None or result.fell_back:
        return max(0, plan.num_tokens - result.num_cached_tokens)
    ran = plan.recompute_depth > 0
    if planned.policy.two_step:
        ran |= plan.is_text
    return int(ran.sum())
