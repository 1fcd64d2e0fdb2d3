"""Load shedding by a TTFT target (Ingress Serve replica): `SheddingGuard`, an ASGI middleware in
front of the generation routes, answers 429 `server_overloaded` with `Retry-After` (OpenAI's JSON
error body) before a request is queued anywhere once admitting it would break the TTFT target.

The bound follows from Little's law on the queue of requests waiting for their first token. With
`W` admitted requests waiting (admitted, no response started yet) and `σ` the rate at which
requests get their first token (response starts per second of busy time, measured over the last
`window_s` seconds, the busy time before the window's first one included:
`TTFTAdmission.rate`), a new request waits about `(W + 1) / σ` seconds. It is admitted while

    W + 1 <= max(1, floor(σ · T))        T = limits.ttft_target_s

so an admitted request's expected TTFT stays under T (the queue ahead of it drains at σ), and
whatever arrives beyond is refused at once instead of waiting past T. Little's law bounds the
mean; the tail of the TTFT is longer (σ moves, CPU contention slows the engine), so the bound is
scaled by a gain g in [0.05, 1] that tracks the p99: `bound = max(1, floor(g · σ · T))`, where
each admitted stream's own server-side TTFT (admission to its first chunk) over T multiplies g
by 0.9 and each one under T adds 0.1 · (1 - 0.99) / 0.99 (an AIMD loop whose fixed point has
about 1 % of the TTFTs over T). Before σ is measured (fewer than `min_samples` first tokens seen)
it is `limits.shed_initial_rate`. `Retry-After` is the time the backlog above the bound needs to
drain, `ceil((W + 1 - bound) / σ)`, 1 to 60 s.

The bound is engine-agnostic (it counts what waits anywhere behind the ingress, the vLLM
worker's own queue included), but on the vLLM worker it alone does not hold the target: vLLM
batches, so σ is high (64 clients at a TTFT p50 of 6.8 s on the small LLaVA mean σ ≈ 9/s) and
`σ · T` (~90 at T = 10 s) is above what 64 clients ever have waiting: everything was admitted
and waited in Serve's queue in front of the worker (whose `max_ongoing_requests` of 16 held it
below its budget), with a TTFT p99 of 11.1 s, and a burst let in more than that queue holds
(Serve's back-pressure, then answered 503). The LLM worker's engine budget is therefore sized
from what vLLM runs and queues (`mpic.deployments.serve.admission.worker_capacity`:
`max_num_seqs` running + one batch waiting by default) and the worker's Serve bounds are derived
from it (`deployments/app.py`), so a request past what the engine can start soon gets 429
`engine_overloaded` at once and an admitted one waits for about one batch at most; this guard
keeps the bound where `σ · T` is the tighter one (the reference engine, one request at a time).

Each ingress replica measures its own σ (its own share of the first tokens), so the bound scales
with the replicas without shared state. The application's bound must act before Ray Serve's: the
app builder gives the Ingress deployment `max_ongoing_requests >= limits.max_pending_requests`
(`deployments/app.py`), so Serve's proxy never queues past its own bound and answers plain-text
503s; rejections pass the ingress's request counter (`mpic_requests_total{outcome="429"}`) and
this guard's own `stats()`.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions")
"""POST routes that start a generation (the ones shed)."""
QUANTILE = 0.99
"""The TTFT quantile the gain keeps at the target."""


@dataclass
class ShedDecision:
    """The outcome of one admission check."""

    admitted: bool
    bound: int
    waiting: int
    rate: float
    retry_after: int = 1


class TTFTAdmission:
    """Admitted-but-not-started requests of one replica against the TTFT-derived bound;
    thread-safe. `clock` is injectable for tests."""

    def __init__(
        self,
        ttft_target_s: float,
        initial_rate: float = 1.0,
        max_pending: int = 1024,
        window_s: float = 10.0,
        min_samples: int = 4,  # at least 2: a rate needs an interval
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.target, self.initial_rate = ttft_target_s, initial_rate
        self.max_pending, self.window_s, self.min_samples = max_pending, window_s, min_samples
        self.clock = clock
        self.waiting = 0
        self.admitted = self.rejected = 0
        self.gain = 1.0  # p99 feedback (module docstring)
        self.min_gain, self.decrease = 0.05, 0.9
        self.increase = (1 - self.decrease) * (1 - QUANTILE) / QUANTILE
        self._busy_total = 0.0  # seconds with at least one request waiting
        self._busy_since: float | None = None
        self._starts: deque[tuple[float, float]] = deque()  # (time, busy_total) per first token
        self._busy_ref = 0.0  # busy_total at the last first token before the window
        self._lock = threading.Lock()

    def _busy_now(self, now: float) -> float:
        return self._busy_total + (now - self._busy_since if self._busy_since is not None else 0)

    def rate(self, now: float | None = None) -> float:
        """First tokens per busy second over the last `window_s` seconds (σ): the first tokens
        in the window over the busy time since the last first token before it (since the start
        when there is none), so the wait before a clump of first tokens counts: a batching
        engine (vLLM) hands out first tokens in clumps, a batch's prefills ending together, and
        a rate timed from the clump's own first member would be near infinite. A stalled
        engine's rate decays as its busy time grows without first tokens."""
        now = self.clock() if now is None else now
        while self._starts and self._starts[0][0] < now - self.window_s:
            self._busy_ref = self._starts.popleft()[1]
        if len(self._starts) < self.min_samples:
            return self.initial_rate
        busy = self._busy_now(now) - self._busy_ref
        return len(self._starts) / busy if busy > 1e-3 else self.initial_rate

    def bound(self, rate: float) -> int:
        """Most requests that may wait for their first token: max(1, floor(g · σ · T))."""
        return max(1, min(self.max_pending, math.floor(self.gain * rate * self.target)))

    def try_admit(self) -> ShedDecision:
        """Admit one request (count it waiting) or refuse it with a Retry-After."""
        with self._lock:
            now = self.clock()
            rate = self.rate(now)
            bound = self.bound(rate)
            if self.waiting + 1 > bound:
                self.rejected += 1
                excess = self.waiting + 1 - bound
                retry = max(1, math.ceil(excess / max(rate, 1e-6)))
                return ShedDecision(False, bound, self.waiting, rate, min(retry, 60))
            if self.waiting == 0:
                self._busy_since = now
            self.waiting += 1
            self.admitted += 1
            return ShedDecision(True, bound, self.waiting, rate)

    def started(self, first_token: bool, waited_s: float | None = None) -> None:
        """An admitted request's response started (its first token, or an answer without one:
        an error) after `waited_s` seconds; only first tokens count towards σ and the gain."""
        with self._lock:
            now = self.clock()
            if first_token:
                self._starts.append((now, self._busy_now(now)))
                if waited_s is not None:
                    if waited_s > self.target:
                        self.gain = max(self.min_gain, self.gain * self.decrease)
                    else:
                        self.gain = min(1.0, self.gain + self.increase)
            self.waiting -= 1
            if self.waiting == 0 and self._busy_since is not None:
                self._busy_total += now - self._busy_since
                self._busy_since = None

    def stats(self) -> dict[str, float]:
        """Current figures (tests, logs)."""
        with self._lock:
            rate = self.rate()
            return {
                "waiting": self.waiting,
                "bound": self.bound(rate),
                "rate": rate,
                "admitted": self.admitted,
                "rejected": self.rejected,
                "gain": self.gain,
            }


class SheddingGuard:
    """ASGI middleware: TTFT admission on POST generation routes (see the module docstring).
    `admission` None (a `ttft_target_s` of 0, or not configured yet): everything passes."""

    admission: TTFTAdmission | None = None  # set per replica by `configure_shedding`

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        adm = SheddingGuard.admission
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        if (
            adm is None
            or scope["type"] != "http"
            or scope.get("method") != "POST"
            or path not in GENERATION_ROUTES
        ):
            return await self.app(scope, receive, send)
        t0 = time.monotonic()
        decision = adm.try_admit()
        if not decision.admitted:
            scope["route"] = SimpleNamespace(path=path)  # the request counter's route label
            return await _send_overloaded(send, decision)
        started = False

        async def watched_send(message):
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                ok = message.get("status") == 200
                headers = dict(message.get("headers") or [])
                streamed = headers.get(b"content-type", b"").startswith(b"text/event-stream")
                # a stream starts at its first token: its wait is the TTFT the gain tracks; a
                # non-streaming answer starts when it is complete (not a TTFT)
                adm.started(first_token=ok, waited_s=time.monotonic() - t0 if streamed else None)
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        finally:
            if not started:
                adm.started(first_token=False)


def configure_shedding(limits: Any) -> TTFTAdmission | None:
    """Install this replica's admission from `LimitsConfig` (None when the target is 0)."""
    if not limits.ttft_target_s:
        SheddingGuard.admission = None
    else:
        SheddingGuard.admission = TTFTAdmission(
            limits.ttft_target_s, limits.shed_initial_rate, limits.max_pending_requests
        )
    return SheddingGuard.admission


async def _send_overloaded(send, d: ShedDecision) -> None:
    message = (
        f"the server is at capacity: {d.waiting} requests wait for their first token and "
        f"admitting more would break the TTFT target (about {d.rate:.2f} first tokens/s); retry "
        f"after {d.retry_after} s"
    )
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "rate_limit_error",
                "param": None,
                "code": "server_overloaded",
            }
        }
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(d.retry_after).encode()),
    ]
    await send({"type": "http.response.start", "status": 429, "headers": headers})
    await send({"type": "http.response.body", "body": body})
