"""The live fidelity guarantee (LLM-worker Serve replica): a sampled fraction of served requests
gets a shadow exact prefill of the same prompt, off the critical path, and the drift of the
served answer from the exact one goes to `/metrics`, the logs and the budget loop.

Per served request (`FidelityMonitor`):
1. `wants(prompt)`: sampled with probability `fidelity.sample_rate` (never for policy `full`,
   which is exact already); a sampled request asks its engine to capture the served pass's
   first-token distribution (`LinkedPrompt.capture_first_token`, returned in
   `DoneEvent.first_token` and stripped by the worker before the ingress sees it).
2. `submit(...)` after the answer finished (the worker's generator is done and the request has
   left the admission budget): a background task, unless the replica is busy - more than
   `fidelity.shed_above` other requests admitted (running or waiting for the engine), or a
   shadow already pending - in which case the shadow is shed (counted, never queued). Right
   before it starts, after `fidelity.idle_s`, it is shed too if any request arrived meanwhile or
   the load grew (back-to-back traffic whose next request is still in the ingress is not yet
   admitted here; the arrival count sees it).
3. The shadow: `ServeEngine.exact_pass` (policy `full`) and `compare`:
   - reference engine: both passes' full first-token logits [V]; KL(exact || served) in float64
     exactly as `mpic bench fidelity` computes it, and top-1 agreement;
   - vLLM: vLLM returns logprobs, not logits. The served pass asks for its top-k raw logprobs
     (`TOP_K` = 20, vLLM's `raw_logprobs`: before temperature and penalties); the shadow asks
     for the exact logprobs of exactly those k token ids (`logprob_token_ids`). The reported
     `topk` KL is KL(p_S || q_S) with both distributions renormalised over the served top-k set
     S (not the full-vocabulary KL: the served pass's probabilities outside S are not returned);
     top-1 agreement is exact (served rank-1 token vs the exact greedy token).
   - the answer (greedy requests: temperature 0, no penalties, no logit bias, no min_tokens, no
     stop strings or stop tokens, which cut it): the shadow also decodes the exact greedy
     answer, `fidelity.answer_tokens` tokens at most (and the request's `max_tokens`), and the
     served answer's agreement with it is the share of those L positions with the same token
     (`mpic.engine.answers.token_agreement`, `mpic bench fidelity`'s `agreement_32` at L; an
     answer that ended is padded past its end token, so two answers that end together agree
     from there on). The first token alone says whether the answer starts right; this says
     whether it stays with the exact one.
4. Results: histograms `mpic_fidelity_kl{policy}` (full-vocabulary KL), `mpic_fidelity_topk_kl`
   (vLLM's top-k KL), `mpic_fidelity_top1_agreement{policy}` (0 or 1 per sample: its mean is
   the agreement rate), `mpic_fidelity_answer_agreement{policy}` (the answer's agreement);
   `mpic_fidelity_shadows{outcome}` counts run / shed_load / shed_pending / failed;
   `mpic_fidelity_recompute_budget` is the loop's current default budget. `policy` is the
   policy family (`mpic`, `cacheblend`, ...), bounded whatever a request names. One INFO log
   line per sample names the request id. With `fidelity.fidelity_target` set, the samples of
   requests served at the default budget (they named neither a policy nor a budget) feed the
   `BudgetController` (`mpic.deployments.monitoring.fidelity_control`).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from mpic.deployments.config import FidelityConfig
from mpic.deployments.messages import LinkedPrompt
from mpic.deployments.monitoring.fidelity_control import (
    BudgetController,
    ControllerBounds,
    budgeted,
)
from mpic.deployments.monitoring.metrics import policy_label
from mpic.engine.answers import token_agreement
from mpic.engine.first_token import FirstToken, compare

if TYPE_CHECKING:
    from mpic.deployments.engines.engine import ServeEngine
    from mpic.types import CacheEntry

logger = logging.getLogger(__name__)

_KL_BUCKETS = [1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0]
"""vLLM: top-k raw logprobs the served pass returns for the comparison (vLLM's default
`max_logprobs`, the most a request may ask for)."""


@dataclass
class FidelitySample:
    """One shadow comparison."""

    request_id: str
    policy: str
    kl: float
    """KL(exact || served) in nats: full vocabulary (`kind` full) or over the top-k set."""
    top1_agree: bool
    kind: Literal["full", "topk"]
    defaulted: bool = False
    """The request was served at the default budget (only these samples feed the loop)."""
    token_ids: list[int] | None = None
    """`topk` kind: the served top-k token ids the KL runs over."""
    answer_agreement: float | None = None
    """Share of the first `answer_tokens` positions of the served greedy answer equal to the
    exact one's; None when not compared (a sampled request, or `answer_tokens` 0)."""


class _Metrics:
    """The monitor's Ray Serve series (no-ops outside a Ray cluster)."""

    def __init__(self) -> None:
        from ray.serve.metrics import Counter as RayCounter
        from ray.serve.metrics import Gauge, Histogram

        self.kl = Histogram(
            "mpic_fidelity_kl",
            description="Sampled first-token KL(exact || served), full vocabulary, nats.",
            boundaries=_KL_BUCKETS,
            tag_keys=("policy",),
        )
        self.topk_kl = Histogram(
            "mpic_fidelity_topk_kl",
            description="Sampled first-token KL(exact || served) over the served top-k tokens "
            "(vLLM: logprobs, not logits, are returned), renormalised, nats.",
            boundaries=_KL_BUCKETS,
            tag_keys=("policy",),
        )
        self.top1 = Histogram(
            "mpic_fidelity_top1_agreement",
            description="1 when the served first token's argmax equals the exact one's, else 0.",
            boundaries=[0.5],
            tag_keys=("policy",),
        )
        self.answer = Histogram(
            "mpic_fidelity_answer_agreement",
            description="Share of a sampled greedy answer's first tokens (fidelity."
            "answer_tokens) equal to the exact answer's.",
            boundaries=[0.1, 0.25, 0.5, 0.75, 0.9, 0.99],
            tag_keys=("policy",),
        )
        self.shadows = RayCounter(
            "mpic_fidelity_shadows",
            description="Shadow exact prefills by outcome (run, shed_load, shed_pending, failed).",
            tag_keys=("outcome",),
        )
        self.budget = Gauge(
            "mpic_fidelity_recompute_budget",
            description="The default recompute budget the fidelity loop currently applies.",
        )


class FidelityMonitor:
    """Sampling, shedding, shadow passes and their accounting for one LLM-worker replica."""

    def __init__(
        self,
        cfg: FidelityConfig,
        engine: ServeEngine,
        load: Callable[[], int],
        start_budget: float | None,
    ) -> None:
        """load: requests admitted on this replica right now (the admission budget's count).
        start_budget: the server's configured default recompute budget (None: none)."""
        self.cfg, self.engine, self.load = cfg, engine, load
        self.start_budget = start_budget
        self._rng = random.Random(cfg.seed)
        self.counts: Counter[str] = Counter()
        self.samples: deque[FidelitySample] = deque(maxlen=1024)
        self._pending = 0
        self.arrivals = 0
        """Requests this replica was asked to serve (every `wants` call): a shadow waits until
        none arrived for `fidelity.idle_s` (requests still in the ingress or resolver, not yet
        admitted here, are invisible to the admission count)."""
        self._tasks: set[asyncio.Task] = set()
        self.metrics = _Metrics()
        self.controller: BudgetController | None = None
        if cfg.fidelity_target is not None:
            bounds = ControllerBounds(
                cfg.fidelity_target,
                cfg.min_budget,
                cfg.max_budget,
                cfg.step,
                cfg.hysteresis,
                cfg.min_samples,
            )
            start = cfg.max_budget if start_budget is None else start_budget
            self.controller = BudgetController(bounds, start)
            self.metrics.budget.set(self.controller.budget)

    @property
    def enabled(self) -> bool:
        """True when requests may be sampled (rate > 0 and the engine can run shadows)."""
        return self.cfg.sample_rate > 0 and self.engine.supports_fidelity

    @property
    def pending(self) -> int:
        """Shadows started and not finished."""
        return self._pending

    def default_policy(self, prompt: LinkedPrompt) -> None:
        """A request that named neither a policy nor a budget is served at the default
        recompute budget: the loop's current one, else the configured `recompute_budget`
        (the prompt's policy replaced in place by `budgeted`'s, parsed once per budget;
        neither: the resolver's `default_policy` stays)."""
        budget = self.controller.budget if self.controller is not None else self.start_budget
        if budget is not None and prompt.policy_defaulted:
            policy = budgeted(budget)
            prompt.serve_by(policy.name, policy)

    def wants(self, prompt: LinkedPrompt) -> bool:
        """Draw whether this request gets a shadow; marks the prompt to capture its served
        first-token distribution when it does."""
        self.arrivals += 1
        if not self.enabled or prompt.policy == "full":
            return False
        if self._rng.random() >= self.cfg.sample_rate:
            return False
        prompt.capture_first_token = True
        return True

    def _shed(self) -> str | None:
        if self._pending >= self.cfg.max_pending:
            return "shed_pending"
        if self.load() > self.cfg.shed_above:
            return "shed_load"
        return None

    def _count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        self.metrics.shadows.inc(1, tags={"outcome": outcome})

    def submit(
        self,
        prompt: LinkedPrompt,
        entries: dict[str, CacheEntry],
        served: FirstToken | None,
    ) -> asyncio.Task | None:
        """After a sampled request finished: start its shadow in the background (the task), or
        shed it (None). Call from the worker's event loop."""
        if served is None:  # the engine did not capture it (e.g. an exact fallback served it)
            self._count("not_captured")
            return None
        if (why := self._shed()) is not None:
            self._count(why)
            return None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a generator finalised outside its loop: nothing can run it
            self._count("failed")
            return None
        self._pending += 1
        task = loop.create_task(self._shadow(prompt, entries, served))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _shadow(
        self, prompt: LinkedPrompt, entries: dict[str, CacheEntry], served: FirstToken
    ) -> FidelitySample | None:
        try:
            seen = self.arrivals
            await asyncio.sleep(self.cfg.idle_s)  # the answer's last bytes leave first
            if self.arrivals != seen or self.load() > self.cfg.shed_above:  # traffic: shed
                self._count("shed_load")
                return None
            self._count("run")
            length = self._answer_length(prompt, served)
            exact = await self.engine.exact_pass(prompt, entries, served, length)
            kl, agree, kind = compare(exact, served)
            answer = None
            if length and exact.answer is not None and served.answer is not None:
                answer = token_agreement(served.answer, exact.answer, length, None)
        except Exception as exc:  # noqa: BLE001 - a shadow never hurts serving
            self._count("failed")
            logger.warning("request %s: fidelity shadow failed: %s", prompt.request_id, exc)
            return None
        finally:
            self._pending -= 1
        ids = served.token_ids if kind == "topk" else None
        sample = FidelitySample(
            prompt.request_id, prompt.policy, kl, agree, kind, prompt.policy_defaulted, ids, answer
        )
        return self.record(sample)

    def _answer_length(self, prompt: LinkedPrompt, served: FirstToken) -> int:
        """How many answer tokens the shadow compares: `fidelity.answer_tokens` capped by the
        request's `max_tokens`; 0 for a sampled (not greedy) request or no captured answer."""
        s = prompt.sampling
        greedy = s.temperature == 0 and not s.logit_bias
        greedy &= s.presence_penalty == 0 and s.frequency_penalty == 0
        greedy &= s.repetition_penalty == 1 and s.min_tokens == 0
        greedy &= not s.stop and not s.stop_token_ids  # a cut answer: drift past it unseen
        if not greedy or served.answer is None:
            return 0
        return min(self.cfg.answer_tokens, prompt.max_tokens)

    def record(self, sample: FidelitySample) -> FidelitySample:
        """Metrics, log line and the budget loop for one sample."""
        family = policy_label(sample.policy)
        (self.metrics.kl if sample.kind == "full" else self.metrics.topk_kl).observe(
            sample.kl, tags={"policy": family}
        )
        self.metrics.top1.observe(float(sample.top1_agree), tags={"policy": family})
        if sample.answer_agreement is not None:
            self.metrics.answer.observe(sample.answer_agreement, tags={"policy": family})
        self.samples.append(sample)
        answer = (
            "" if sample.answer_agreement is None else f", answer {sample.answer_agreement:.2f}"
        )
        logger.info(
            "request %s: fidelity %s KL %.6g, top-1 %s%s (policy %s)",
            sample.request_id,
            sample.kind,
            sample.kl,
            "agrees" if sample.top1_agree else "differs",
            answer,
            sample.policy,
            extra={
                "request_id": sample.request_id,
                "fidelity_kl": sample.kl,
                "fidelity_kind": sample.kind,
                "fidelity_top1_agree": sample.top1_agree,
                "fidelity_answer_agreement": sample.answer_agreement,
                "policy": sample.policy,
            },
        )
        if self.controller is not None and sample.defaulted:  # the budget serves these only
            self.controller.observe(sample.kl)
            self.metrics.budget.set(self.controller.budget)
        return sample

    async def drain(self) -> None:
        """Wait for the shadows in flight (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def stats(self) -> dict[str, Any]:
        """Counts by outcome, the samples' mean KL and agreement, and the loop's budget."""
        out: dict[str, Any] = {f"shadows_{k}": v for k, v in self.counts.items()}
        out["samples"] = len(self.samples)
        if self.samples:
            out["kl_mean"] = sum(s.kl for s in self.samples) / len(self.samples)
            out["top1_agreement"] = sum(s.top1_agree for s in self.samples) / len(self.samples)
            answers = [s.answer_agreement for s in self.samples if s.answer_agreement is not None]
            if answers:
                out["answer_agreement"] = sum(answers) / len(answers)
        if self.controller is not None:
            out["recompute_budget"] = self.controller.budget
        return out
