"""Admission control and engine health (LLM-worker and Ingress Serve replicas).

Load is answered 429 with `Retry-After`; 503 is kept for an engine that is dead or not ready.
Three layers keep an overloaded deployment answering fast instead of queueing without bound:

1. The LLM worker's engine budget (`EngineBudget`): at most `max_requests` generations and
   `max_tokens` tokens (estimated prompt tokens + max_tokens of every admitted request) per
   replica; a request past either bound gets 429 `engine_overloaded` with `Retry-After` before
   any entry is loaded or any KV allocated. `worker_capacity` sizes it: `limits.
   max_requests_in_flight` / `max_tokens_in_flight`, and for the vLLM engine no more than vLLM
   holds (`max_num_seqs` running + `limits.engine_queue_seqs` waiting in vLLM's queue, and the
   tokens of its KV blocks where they are known), so a request past what the engine can start
   soon is refused instead of waiting in vLLM's queue past the TTFT target.
2. Serve's own bounds per deployment (`max_ongoing_requests`, `max_queued_requests`): the app
   builder derives them from the budget (`deployments/app.py`: the worker's
   `max_ongoing_requests` >= the budget + `WORKER_SIDE_CALLS`, the queues of the deployments on
   the generation path unbounded while the ingress's TTFT admission bounds what enters), so the
   budget, not Serve's queue, refuses first. Should a queue still fill (an explicit bound in
   the config, or a caller outside the ingress's admission), Serve's back-pressure error is load
   on an internal hop, not an outage: `as_backpressure` answers it 429 `engine_overloaded` with
   `Retry-After` as well.
3. A dead engine (vLLM's `EngineDeadError`, an `AsyncLLM` that reports `errored`): requests get
   503 `engine_unavailable` with `Retry-After`, and the replica's `check_health` fails so Serve
   replaces it (`EngineHealth`).

Every rejection is counted by the ingress's request counter (`mpic_requests_total`, outcome
"429" / "503").

**Retry-After** says when capacity is likely back, by one recipe (`retry_wait`): the expected
wait for a slot, clamped to [1 s, `RETRY_AFTER_MAX_S`], as the integer `Retry-After` (HTTP's
delay-seconds, rounded up) and `retry-after-ms` (milliseconds, which OpenAI's clients read
first). The ingress's TTFT admission (`mpic.deployments.http.shedding`) knows the wait: the
backlog above its bound over the measured first-token rate. The worker's budget estimates it
by Little's law from the generations it holds: a slot frees about every `mean generation time /
requests in flight` seconds (`EngineBudget.expected_wait_s`), at least `limits.retry_after_s`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mpic.errors import MPICError


class OverloadedError(MPICError):
    """The engine's budget is spent (HTTP 429 with Retry-After)."""

    status = 429
    type = "rate_limit_error"
    code = "engine_overloaded"

    def __init__(
        self, message: str, *, retry_after: int = 1, retry_after_ms: int | None = None
    ) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.retry_after_ms = retry_after_ms


RETRY_AFTER_MAX_S = 60
"""Longest wait a refusal announces: OpenAI's Python client honours a `Retry-After` of up to 60 s
(120 s in recent releases) and does not retry past it."""


def retry_wait(wait_s: float, max_s: int = RETRY_AFTER_MAX_S) -> tuple[int, int]:
    """(Retry-After s, retry-after-ms) of a refusal whose client can expect capacity back in
    about `wait_s` seconds: the wait clamped to [1 s, `max_s`], in milliseconds rounded up, and
    in whole seconds rounded up (so `Retry-After` is never earlier than `retry-after-ms`)."""
    wait = wait_s if math.isfinite(wait_s) else float(max_s)
    ms = math.ceil(min(max(wait, 1.0), float(max_s)) * 1000 - 1e-6)
    return math.ceil(ms / 1000), ms


def retry_headers(retry_after: int, retry_after_ms: int | None = None) -> list[tuple[bytes, bytes]]:
    """The raw ASGI headers of a refusal: `retry-after` (integer seconds) and, when known,
    `retry-after-ms`."""
    out = [(b"retry-after", str(retry_after).encode())]
    if retry_after_ms is not None:
        out.append((b"retry-after-ms", str(retry_after_ms).encode()))
    return out


class EngineUnavailableError(MPICError):
    """The engine is dead (HTTP 503 with Retry-After)."""

    status = 503
    type = "server_error"
    code = "engine_unavailable"

    def __init__(self, message: str, *, retry_after: int = 5) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineBudget:
    """Requests and tokens in flight on one LLM-worker replica; thread-safe. `clock` is
    injectable for tests."""

    def __init__(
        self,
        max_requests: int,
        max_tokens: int,
        retry_after_s: int = 1,
        clock: Any = None,
    ) -> None:
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.retry_after = retry_after_s  # the least wait a refusal announces
        self.requests = self.tokens = 0
        self.rejected = 0
        self.clock = clock or time.monotonic
        self.mean_s: float | None = None  # moving mean of a generation's time in the budget
        self._lock = threading.Lock()

    def expected_wait_s(self) -> float:
        """Seconds until a slot is likely free (Little's law: the requests in flight leave at
        about `requests / mean generation time` per second), at least `retry_after_s`; before
        any generation has finished, `retry_after_s`. Call with the lock held."""
        if self.mean_s is None or self.requests == 0:
            return float(self.retry_after)
        return max(float(self.retry_after), self.mean_s / self.requests)

    @contextmanager
    def admit(self, cost: int) -> Iterator[None]:
        """Hold `cost` tokens and one request slot for the block; OverloadedError (429) when
        either bound would be passed. A single request larger than the whole token budget is
        admitted only when nothing else runs (it can never fit otherwise)."""
        with self._lock:
            busy = self.requests > 0
            if self.requests >= self.max_requests or (
                busy and self.tokens + cost > self.max_tokens
            ):
                self.rejected += 1
                retry, retry_ms = retry_wait(self.expected_wait_s())
                raise OverloadedError(
                    f"the engine is at capacity ({self.requests} requests, {self.tokens} tokens "
                    f"in flight); retry after {retry} s",
                    retry_after=retry,
                    retry_after_ms=retry_ms,
                )
            self.requests += 1
            self.tokens += cost
        t0 = self.clock()
        try:
            yield
        finally:
            took = self.clock() - t0
            with self._lock:
                self.requests -= 1
                self.tokens -= cost
                # a moving mean over about the last 20 generations
                self.mean_s = (
                    took if self.mean_s is None else self.mean_s + (took - self.mean_s) / 20
                )

    def stats(self) -> dict[str, int]:
        """Current load and rejections (engine_stats)."""
        with self._lock:
            return {
                "requests_in_flight": self.requests,
                "tokens_in_flight": self.tokens,
                "budget_rejected": self.rejected,
            }


DEAD_ENGINE_ERRORS = ("EngineDeadError", "EngineGenerateError")
"""Exception class names (vLLM v1's) that mean the engine process is gone."""


def is_engine_death(exc: BaseException) -> bool:
    """True when `exc` (or its cause chain) is an engine-death error."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if type(seen).__name__ in DEAD_ENGINE_ERRORS:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class EngineHealth:
    """Whether the engine of this replica still works: set dead on an engine-death error or
    when the engine itself reports so (vLLM's `AsyncLLM.errored`)."""

    def __init__(self, engine: object) -> None:
        self.engine = engine
        self.dead_reason: str | None = None

    def _engine_errored(self) -> bool:
        llm = getattr(getattr(self.engine, "vllm", None), "llm", None)
        try:
            return bool(getattr(llm, "errored", False))
        except Exception:  # noqa: BLE001 - a broken engine client counts as dead
            return True

    def dead(self) -> bool:
        """True once the engine died (sticky: a replica never comes back, Serve replaces it)."""
        if self.dead_reason is None and self._engine_errored():
            self.dead_reason = "the engine reports errored"
        return self.dead_reason is not None

    def mark_dead(self, exc: BaseException) -> None:
        """Record an engine-death error."""
        self.dead_reason = self.dead_reason or type(exc).__name__

    def unavailable(self) -> EngineUnavailableError:
        """The 503 a request gets while this replica's engine is dead (no internals)."""
        return EngineUnavailableError(
            "the model engine of this replica stopped and is being restarted; retry shortly",
            retry_after=5,
        )

    def check(self) -> None:
        """Serve's `check_health`: raises while the engine is dead (Serve then restarts the
        replica)."""
        if self.dead():
            raise RuntimeError(f"engine dead: {self.dead_reason}")


BACKPRESSURE_ERRORS = ("BackPressureError",)
"""Ray Serve's queue-full error class names (a deployment past `max_queued_requests`)."""

QUEUE_FULL_MESSAGE = "the service is at capacity (request queue full); retry later"


def queue_full(retry_after: int = 1) -> OverloadedError:
    """The 429 for a full Serve queue: load, not an outage (module docstring, layer 2)."""
    retry, retry_ms = retry_wait(retry_after)
    return OverloadedError(QUEUE_FULL_MESSAGE, retry_after=retry, retry_after_ms=retry_ms)


def as_backpressure(exc: BaseException) -> OverloadedError | None:
    """The 429 `engine_overloaded` (Retry-After 1) for Serve's back-pressure error (or one
    wrapping it), else None."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        if type(seen).__name__ in BACKPRESSURE_ERRORS:
            return queue_full()
        seen = getattr(seen, "cause", None) or seen.__cause__ or seen.__context__
    return None


WORKER_SIDE_CALLS = 8
"""Calls beside generations one LLM-worker replica takes with a full budget (tokenize, uploads,
context length, stats, routing probes): its derived Serve `max_ongoing_requests` is the budget's
`max_requests` plus these."""


def worker_capacity(config: Any, num_gpu_blocks: int | None = None) -> tuple[int, int]:
    """(requests, tokens) one LLM-worker replica admits (its `EngineBudget`), from
    `ServeAppConfig` `config`: `limits.max_requests_in_flight` and `limits.max_tokens_in_flight`,
    and for the vLLM engine at most `max_num_seqs + limits.engine_queue_seqs` requests (what vLLM
    runs at once plus what waits in its queue) and the tokens of its KV cache (`num_gpu_blocks`,
    as vLLM reports it once started, else the configured `num_blocks`, times `block_size`)."""
    lim, eng = config.limits, config.engine
    requests, tokens = lim.max_requests_in_flight, lim.max_tokens_in_flight
    seqs = getattr(eng, "max_num_seqs", None)  # vLLM's settings (`engine.kind: vllm`)
    if getattr(eng, "kind", None) == "vllm" and seqs is not None:
        queued = seqs if lim.engine_queue_seqs is None else lim.engine_queue_seqs
        requests = min(requests, seqs + queued)
        blocks = num_gpu_blocks or getattr(eng, "num_blocks", None)
        if blocks:
            tokens = min(tokens, blocks * eng.block_size)
    return requests, tokens


def engine_batch(config: Any) -> int | None:
    """The requests the engine starts at once, one ingress replica's share, for the ingress's
    batching-aware TTFT admission (`mpic.deployments.http.shedding`: whole batches, one batch
    before the first-token rate is measured): for the vLLM engine `max_num_seqs` times
    the LLM-worker replicas Serve starts with, over the ingress replicas (at least 1); None for
    an engine that serves one request at a time or is not known to batch (the reference, the
    fake, a custom class)."""
    eng = config.engine
    seqs = getattr(eng, "max_num_seqs", None)
    if getattr(eng, "kind", None) != "vllm" or seqs is None:
        return None
    workers = max(1, config.llm_worker.autoscaling.min_replicas)
    ingresses = max(1, config.ingress.autoscaling.min_replicas)
    return max(1, seqs * workers // ingresses)
