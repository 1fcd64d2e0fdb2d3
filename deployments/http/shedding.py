"""Load shedding by a TTFT target (Ingress Serve replica): `SheddingGuard`, an ASGI middleware in
front of the generation routes, answers 429 `server_overloaded` with `Retry-After` (OpenAI's JSON
error body) before a request is queued anywhere once admitting it would break the TTFT target.

The bound follows from Little's law on the queue of requests waiting for their first token. With
`W` admitted requests waiting (admitted, no response started yet) and `σ` the rate at which
requests get their first token (response starts per second of busy time, measured over the last
`window_s` seconds, the busy time before the window's first one included:
`TTFTAdmission.rate`), a new request waits about `(W + 1) / σ` seconds. It is admitted while

    W + 1 <= max(1, floor(σ · T))        T = limits.ttft_target_s · (1 - limits.ttft_headroom)

so an admitted request's expected TTFT stays under T (the queue ahead of it drains at σ), and
whatever arrives beyond is refused at once instead of waiting past T. Little's law bounds the
mean; the tail of the TTFT is longer (σ moves, CPU contention slows the engine), so the bound is
scaled by a gain g in [0.05, 1] that tracks the p99: `bound = max(1, floor(g · σ · T))`, where
each admitted stream's own server-side TTFT (admission to its first chunk) over T multiplies g
by 0.9 and each one under T adds 0.1 · (1 - 0.99) / 0.99 (an AIMD loop whose fixed point has
about 1 % of the TTFTs over T). Before σ is measured (fewer than `min_samples` first tokens seen)
it is the prior `limits.shed_initial_rate`. `Retry-After` is when this client's turn likely
comes: the time the backlog above the bound needs to drain, `(W + 1 - bound) / σ`, and then the
clients refused before it, paced one per `1 / σ` (below); 1 to 60 s, as whole seconds (rounded
up) and as `retry-after-ms`, which OpenAI's clients read first
(`mpic.deployments.serve.admission.retry_wait`).

**Pacing the refused.** Capacity comes back at σ, so refused clients are told to come back at σ
too, not all at the drain time: each refusal is told the later of the drain and the previous
refusal's time + `1 / σ` (`_next_return`), so clients that honour `Retry-After` (OpenAI's do)
return one by one instead of as a crowd that is refused again. The turns start over from the
drain once a bound's worth of refused clients is paced ahead (`drain + bound / σ`, a few
seconds): a client that retries early without waiting (and takes a turn each time) cannot push
the others' waits past that, and a burst is spread over that window in layers instead of being
told the same last turn. On 2 shared cores at 64 clients that honour it, 6-22 refusals per
second (median 11 in 8 runs) where the unpaced wait drew 16-30 (median 21 in 6;
docs/serving.md); the goodput moved more with the host's other load than with the pacing.

**The headroom.** The ingress times a request from its own receipt; a client's TTFT also holds
the way there (the client's own loop, the network, Serve's proxy and its queue), which the
ingress cannot see. So T is the target less `limits.ttft_headroom` (default 20 %): with none, on
2 CPU cores shared by clients and server, the ingress timed 1,823 of 1,826 first tokens within
the 10 s target while the clients' p99 was 10.2-11.8 s (docs/serving.md).

**A batching engine** (vLLM; `batch` B = what it starts at once: `max_num_seqs` of the worker
replicas, this ingress replica's share, `mpic.deployments.serve.admission.engine_batch`) hands out
first tokens a batch at a time, and Little's law alone misreads it in two ways:

- *The queue drains in batches.* A request with W others waiting gets its first token after the
  batch running when it came (up to one cycle, `B / σ`) and the `ceil((W + 1) / B)` batches up to
  its own, so its TTFT stays under T while `ceil((W + 1) / B) + 1 <= g · σ · T / B`:

      bound = B · (floor(g · σ · T / B) - 1),   at least B

  whole batches (at σ = 5.3/s, B = 16, T = 10 s: 32, where `floor(σ · T)` let 53 wait). Never
  below one batch: fewer waiting would only shrink the engine's batches, and with them σ and
  the bound.
- *The cold start.* Before σ is measured it is unknown, and a prior rate that is too high (2/s:
  20 admitted at T = 10 s) or the first clump of first tokens (a batch's prefills end together:
  16 after 3 s read as σ ≈ 5.3/s; 16 after 1.5 s as 10.7/s, 80 even in whole batches) lets in
  more than the engine serves within T. What is known without a measurement is the batch the
  engine starts at once, and an idle engine starts it together: the prior is one batch per
  target, `σ0 = B / T`, a cold bound of B. The bound then ramps up only as first tokens justify
  it (TCP's slow start): a cap `R` starts at B, each stream whose first token came within half
  the target raises it by one, every first token keeps it within the measured bound
  (`R <- max(B, min(R + [wait <= T / 2], bound_σ))`), and `bound = min(bound_σ, R)`. A clump
  of k first tokens lets in at most k more, so the cap at most doubles per batch served; a wait
  is seen one wait after its admission, by when the cap may have doubled, so growth stops at
  half the target (TCP stops its slow start for the same reason). After an idle window (σ
  unmeasured again) the bound is back at B.

Slots free a batch at a time, so a refused request's `Retry-After` is at least half a cycle,
`max(W + 1 - bound, B / 2) / σ` (5 s on the prior, at 16 per 10 s; 1.6 s at σ = 5/s, 2 s in
whole seconds). An engine that serves one request at a time (the reference engine) gets no
`batch`: the plain bound, the prior `limits.shed_initial_rate`, no ramp.

The vLLM worker's own budget backs this up: it is sized from what vLLM runs and queues
(`mpic.deployments.serve.admission.worker_capacity`: `max_num_seqs` running + one batch waiting
by default) and the worker's Serve bounds are derived from it (`deployments/app.py`), so a
request past what the engine can start soon gets 429 `engine_overloaded` at once rather than
waiting in Serve's queue in front of the worker.

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

from mpic.deployments.serve.admission import retry_headers, retry_wait

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
    retry_after_ms: int | None = None


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
        batch: int | None = None,
    ) -> None:
        """`batch`: the requests a batching engine starts at once (module docstring): the bound
        is then whole batches, the prior rate `batch / ttft_target_s` (a cold bound of `batch`)
        and the bound ramps up from it; None: the plain bound, the prior `initial_rate`."""
        if batch is not None:
            batch = max(1, min(max_pending, batch))
            initial_rate = batch / ttft_target_s
        self.target, self.initial_rate = ttft_target_s, initial_rate
        self.batch = batch
        self.ramp: int | None = batch  # the slow-start cap (None: no ramp)
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
        self._next_return = 0.0  # when the next refused client should come back (pacing)
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

    def measured_bound(self, rate: float) -> int:
        """What the rate and the p99 gain allow, at most `max_pending`: max(1, floor(g · σ · T));
        for a batching engine whole batches, `batch · (floor(g · σ · T / batch) - 1)`, at least
        one batch (module docstring; a hair of tolerance: `batch / T · T` must give `batch`)."""
        x = self.gain * rate * self.target
        if self.batch is None:
            return max(1, min(self.max_pending, math.floor(x)))
        batches = math.floor(x / self.batch + 1e-9) - 1
        return max(self.batch, min(self.max_pending, self.batch * batches))

    def bound(self, rate: float) -> int:
        """Most requests that may wait for their first token: the measured bound, within the
        ramp cap of a batching engine (module docstring)."""
        measured = self.measured_bound(rate)
        return measured if self.ramp is None else max(1, min(measured, self.ramp))

    def try_admit(self) -> ShedDecision:
        """Admit one request (count it waiting) or refuse it with a Retry-After."""
        with self._lock:
            now = self.clock()
            rate = self.rate(now)
            bound = self.bound(rate)
            if self.waiting + 1 > bound:
                self.rejected += 1
                excess = self.waiting + 1 - bound
                rate_ = max(rate, 1e-6)
                drain = excess / rate_
                if self.batch is not None:  # slots free a batch at a time: half a cycle away
                    drain = max(excess, self.batch / 2) / rate_
                # the clients refused before this one come back first, one per 1 / σ: this
                # one's turn is after them; past a bound's worth of them the turns start over
                # from the drain (module docstring: pacing)
                back = max(now + drain, self._next_return)
                if back > now + drain + bound / rate_:
                    back = now + drain
                self._next_return = back + 1 / rate_
                retry, retry_ms = retry_wait(back - now)
                return ShedDecision(False, bound, self.waiting, rate, retry, retry_ms)
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
                    if self.ramp is not None and self.batch is not None:  # slow start
                        # one more may wait per first token within half the target, never
                        # more than the measurement allows nor less than one batch
                        grow = 1 if waited_s <= self.target / 2 else 0
                        top = self.measured_bound(self.rate(now))
                        self.ramp = max(self.batch, min(self.ramp + grow, top))
            self.waiting -= 1
            if self.waiting == 0 and self._busy_since is not None:
                self._busy_total += now - self._busy_since
                self._busy_since = None

    def stats(self) -> dict[str, float]:
        """Current figures (tests, logs)."""
        with self._lock:
            rate = self.rate()
            out = {
                "waiting": self.waiting,
                "bound": self.bound(rate),
                "rate": rate,
                "admitted": self.admitted,
                "rejected": self.rejected,
                "gain": self.gain,
            }
            if self.ramp is not None:
                out["ramp"] = self.ramp
            return out


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


def configure_shedding(limits: Any, batch: int | None = None) -> TTFTAdmission | None:
    """Install this replica's admission from `LimitsConfig` (None when the target is 0), aiming
    at `ttft_target_s · (1 - ttft_headroom)` (module docstring).
    `batch`: what the engine starts at once, this replica's share
    (`mpic.deployments.serve.admission.engine_batch`; None for an engine that is not batching):
    the cold-start prior and ramp in place of `limits.shed_initial_rate` (module docstring)."""
    if not limits.ttft_target_s:
        SheddingGuard.admission = None
    else:
        SheddingGuard.admission = TTFTAdmission(
            limits.ttft_target_s * (1 - limits.ttft_headroom),
            limits.shed_initial_rate,
            limits.max_pending_requests,
            batch=batch,
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
        *retry_headers(d.retry_after, d.retry_after_ms),
    ]
    await send({"type": "http.response.start", "status": 429, "headers": headers})
    await send({"type": "http.response.body", "body": body})
