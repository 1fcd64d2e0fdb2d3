"""vLLM V1's async engine (`AsyncLLM`) with the MPIC connector: token streaming and continuous
batching of concurrent requests (the Ray Serve LLM worker's engine, `engine.kind: vllm`).

Runs in the process that owns the engine (a Serve replica); vLLM's engine core and worker are
child processes, exactly as for the offline `mpic.engine.vllm.engine.VllmEngine`, with which it
shares config, CPU set-up, engine arguments, request forms, upload prompt and fallback
(`mpic.engine.vllm.frontend.VllmFrontEnd`).

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
import threading
import uuid
from collections.abc import AsyncIterator, Coroutine
from functools import partial
from typing import Any

from mpic.engine.vllm.frontend import VllmEngineConfig, VllmFrontEnd, engine_kwargs
from mpic.engine.vllm.requests import EngineRequest, EngineResult

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


class AsyncVllmEngine(VllmFrontEnd):
    """`AsyncLLM` + the MPIC connector: streamed greedy generation, batched across callers."""

    def __init__(self, cfg: VllmEngineConfig) -> None:
        super().__init__(cfg)
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
        """Stop vLLM's processes and the engine's loop."""
        self.llm.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
