"""The live fidelity monitor's parts without a model (tests/deployments): the budget loop on
synthetic drift sequences, the KL of `compare` against a direct float64 recomputation (full
vocabulary and vLLM's top-k form), and the monitor's sampling and shedding with a stub engine."""

from __future__ import annotations

import asyncio
import math
from collections import namedtuple
from dataclasses import replace

import pytest
import torch

from mpic.deployments.config import FidelityConfig, ServeAppConfig
from mpic.deployments.messages import LinkedPrompt, LinkedTurn, Segment
from mpic.deployments.monitoring.fidelity_control import (
    BudgetController,
    ControllerBounds,
    budget_policy,
)
from mpic.deployments.monitoring.fidelity_monitor import FidelityMonitor
from mpic.engine.first_token import FirstToken, compare

BOUNDS = ControllerBounds(
    target=0.1, min_budget=0.1, max_budget=0.4, step=0.1, hysteresis=0.5, min_samples=4
)


def test_loop_raises_on_high_drift_then_lowers_back() -> None:
    loop = BudgetController(BOUNDS, start=0.1)
    budgets = []
    for _ in range(5 * BOUNDS.min_samples):  # high drift: one step up per window, capped
        loop.observe(0.5)
        budgets.append(loop.budget)
    assert budgets[BOUNDS.min_samples - 2] == 0.1  # no decision before a full window
    assert [budgets[i * 4 + 3] for i in range(5)] == pytest.approx([0.2, 0.3, 0.4, 0.4, 0.4])
    for _ in range(2 * BOUNDS.min_samples):  # inside the dead band [0.05, 0.1]: hold
        loop.observe(0.07)
    assert loop.budget == pytest.approx(0.4)
    for _ in range(5 * BOUNDS.min_samples):  # well below: down to the floor, not beyond
        loop.observe(0.01)
    assert loop.budget == pytest.approx(0.1)
    kinds = [d for d, _, _ in loop.decisions]
    assert kinds == ["raise"] * 5 + ["hold"] * 2 + ["lower"] * 5


def test_loop_decides_on_the_window_mean() -> None:
    loop = BudgetController(BOUNDS, start=0.2)
    for kl in (0.0, 0.0, 0.0, 0.41):  # mean 0.1025 > 0.1 although three samples are exact
        loop.observe(kl)
    assert loop.budget == pytest.approx(0.3)
    assert loop.decisions[-1][1] == pytest.approx(0.1025)


def test_loop_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="min_budget"):
        BudgetController(replace(BOUNDS, min_budget=0.5), start=0.3)
    assert BudgetController(BOUNDS, start=0.9).budget == 0.4  # clamped into the bounds


def test_budget_policy_names_a_registered_policy() -> None:
    from mpic.linker.policies import get_policy

    name = budget_policy(0.25)
    assert get_policy(name).name == name and "0.25" in name


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.softmax(p_logits.double(), -1)
    q = torch.softmax(q_logits.double(), -1)
    return float(sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist(), strict=True)))


def test_compare_full_vocabulary_equals_direct_kl() -> None:
    g = torch.Generator().manual_seed(0)
    exact, served = torch.randn(50, generator=g), torch.randn(50, generator=g)
    kl, agree, kind = compare(FirstToken.from_logits(exact), FirstToken.from_logits(served))
    assert kind == "full" and kl == pytest.approx(_kl(exact, served), abs=1e-12)
    assert agree == (int(exact.argmax()) == int(served.argmax()))
    assert compare(FirstToken.from_logits(exact), FirstToken.from_logits(exact))[:2] == (0.0, True)


Logprob = namedtuple("Logprob", "logprob rank")  # vLLM's Logprob fields the monitor reads


def _step(logits: torch.Tensor, k: int, extra: int | None = None) -> dict:
    """A vLLM logprobs step: the top-k (rank 1..k) and optionally a lower-ranked sampled id."""
    lp = torch.log_softmax(logits.double(), -1)
    order = lp.argsort(descending=True).tolist()
    step = {t: Logprob(float(lp[t]), r + 1) for r, t in enumerate(order[:k])}
    if extra is not None:
        step[extra] = Logprob(float(lp[extra]), order.index(extra) + 1)
    return step


def test_compare_topk_renormalises_over_the_served_set() -> None:
    g = torch.Generator().manual_seed(1)
    exact, served = torch.randn(40, generator=g), torch.randn(40, generator=g)
    k = 5
    low = int(served.argsort()[0])  # the least likely id: a sampled token outside the top-k
    s = FirstToken.from_logprobs(_step(served, k, extra=low), k)
    assert len(s.token_ids) == k and low not in s.token_ids and s.top1 == int(served.argmax())
    ids = s.token_ids
    want = _kl(exact[ids], served[ids])  # softmax over S of logits = renormalised logprobs
    lp = torch.log_softmax(exact.double(), -1)
    e = FirstToken(top1=int(exact.argmax()), token_ids=ids[::-1], logprobs=lp[ids[::-1]].tolist())
    kl, agree, kind = compare(e, s)
    assert kind == "topk" and kl == pytest.approx(want, abs=1e-12)
    assert agree == (int(exact.argmax()) == int(served.argmax()))
    assert compare(FirstToken.from_logits(exact), s)[0] == pytest.approx(want, abs=1e-12)
    with pytest.raises(ValueError, match="lacks"):
        compare(replace(e, token_ids=ids[:-1], logprobs=lp[ids[:-1]].tolist()), s)


class StubEngine:
    """Answers every shadow with fixed exact logits."""

    supports_fidelity = True

    def __init__(self, logits: torch.Tensor, answer: list[int] | None = None) -> None:
        self.logits, self.calls, self.answer, self.lengths = logits, 0, answer, []

    async def exact_pass(self, prompt, entries, served, answer_tokens=0) -> FirstToken:
        self.calls += 1
        self.lengths.append(answer_tokens)
        exact = FirstToken.from_logits(self.logits)
        if answer_tokens:
            exact.answer = (self.answer or [])[:answer_tokens]
        return exact


def _prompt(rid: str, policy: str = "mpic-4", defaulted: bool = False) -> LinkedPrompt:
    turn = LinkedTurn("user", [Segment("text", text="hi")])
    return LinkedPrompt([turn], policy, 4, request_id=rid, policy_defaulted=defaulted)


def test_monitor_samples_sheds_under_load_and_feeds_the_loop() -> None:
    exact, served = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([0.0, 2.0, -1.0])
    engine = StubEngine(exact)
    load = {"n": 0}
    cfg = FidelityConfig(
        sample_rate=1.0, fidelity_target=0.01, min_samples=2, step=0.1, idle_s=0.01
    )
    mon = FidelityMonitor(cfg, engine, lambda: load["n"], start_budget=0.1)

    async def serve(rid: str, defaulted: bool = True):
        p = _prompt(rid, defaulted=defaulted)
        mon.default_policy(p)
        assert mon.wants(p) and p.capture_first_token
        task = mon.submit(p, {}, FirstToken.from_logits(served))
        return p, (await task if task is not None else None)

    async def run():
        load["n"] = 3  # other requests admitted: every shadow is shed, none runs
        for i in range(5):
            assert (await serve(f"busy-{i}"))[1] is None
        assert engine.calls == 0 and mon.counts == {"shed_load": 5}
        load["n"] = 0
        p, sample = await serve("quiet-0")
        assert p.policy == budget_policy(0.1)  # the loop's budget picked the policy
        assert sample.kl == pytest.approx(_kl(exact, served)) and not sample.top1_agree
        await serve("quiet-1")  # second sample of the window: KL 1.3 > 0.01 -> raise
        assert mon.controller.budget == pytest.approx(0.2)
        await serve("named-0", defaulted=False)
        await serve("named-1", defaulted=False)  # named policies never move the budget
        assert mon.controller.budget == pytest.approx(0.2)
        full = _prompt("f", policy="full")
        assert not mon.wants(full)  # exact already

    asyncio.run(run())
    stats = mon.stats()
    assert stats["shadows_run"] == 4 and stats["shadows_shed_load"] == 5
    assert stats["recompute_budget"] == pytest.approx(0.2) and stats["top1_agreement"] == 0.0


def test_monitor_off_by_rate_and_sample_fraction() -> None:
    engine = StubEngine(torch.zeros(3))
    off = FidelityMonitor(FidelityConfig(sample_rate=0.0), engine, lambda: 0, None)
    assert not off.enabled and not any(off.wants(_prompt(str(i))) for i in range(100))
    some = FidelityMonitor(FidelityConfig(sample_rate=0.1, seed=3), engine, lambda: 0, None)
    drawn = sum(some.wants(_prompt(str(i))) for i in range(4000))
    assert 300 < drawn < 500  # ~400 expected (binomial sd ~19)
    p = _prompt("d", defaulted=True)
    some.default_policy(p)
    assert p.policy == "mpic-4"  # no budget configured, no loop: the resolver's default stays


def test_config_defaults_and_limits() -> None:
    cfg = ServeAppConfig()
    assert cfg.fidelity.sample_rate == 0.01 and cfg.fidelity.fidelity_target is None
    with pytest.raises(ValueError):
        ServeAppConfig.model_validate({"fidelity": {"sample_rate": 1.5}})
    with pytest.raises(ValueError):
        ServeAppConfig.model_validate({"fidelity": {"typo": 1}})


def test_monitor_sheds_when_a_request_arrives_while_it_waits() -> None:
    """Back-to-back traffic whose next request is not admitted yet (still in the ingress): the
    admission count is 0, but the arrival during `idle_s` sheds the shadow."""
    engine = StubEngine(torch.zeros(3))
    mon = FidelityMonitor(FidelityConfig(sample_rate=1.0, idle_s=0.2), engine, lambda: 0, None)

    async def run():
        p = _prompt("a")
        assert mon.wants(p)
        task = mon.submit(p, {}, FirstToken.from_logits(torch.zeros(3)))
        await asyncio.sleep(0.05)
        mon.wants(_prompt("b"))  # the next request arrives before the replica was idle 0.2 s
        assert await task is None
        p = _prompt("c")
        assert mon.wants(p)
        assert await mon.submit(p, {}, FirstToken.from_logits(torch.zeros(3))) is not None

    asyncio.run(run())
    assert mon.counts == {"shed_load": 1, "run": 1} and engine.calls == 1


def test_monitor_compares_greedy_answers_only() -> None:
    """A greedy request's answer is compared with the exact greedy answer over min(answer_tokens,
    max_tokens) positions; a sampled one (temperature > 0) and a pass that captured no answer are
    compared on the first token only."""
    from mpic.deployments.messages import Sampling

    exact_answer = [5, 6, 7, 2]  # 2: the end id, then both are padded
    engine = StubEngine(torch.tensor([0.0, 1.0]), answer=exact_answer)
    cfg = FidelityConfig(sample_rate=1.0, idle_s=0.0, answer_tokens=8)
    mon = FidelityMonitor(cfg, engine, lambda: 0, None)

    def served(answer: list[int] | None) -> FirstToken:
        first = FirstToken.from_logits(torch.tensor([0.0, 1.0]))
        first.answer = answer
        return first

    async def run(prompt: LinkedPrompt, answer: list[int] | None):
        assert mon.wants(prompt)
        return await mon.submit(prompt, {}, served(answer))

    greedy = _prompt("g")  # max_tokens 4: 4 positions compared
    sample = asyncio.run(run(greedy, [5, 9, 7, 2]))
    assert sample.answer_agreement == pytest.approx(0.75) and engine.lengths[-1] == 4
    long = LinkedPrompt(greedy.turns, "mpic-4", 32, request_id="l")  # 8 positions: both ended
    assert asyncio.run(run(long, [5, 6, 7, 2])).answer_agreement == 1.0
    assert engine.lengths[-1] == 8
    early = LinkedPrompt(greedy.turns, "mpic-4", 32, request_id="e")  # ends at position 2
    assert asyncio.run(run(early, [5, 2])).answer_agreement == pytest.approx(5 / 8)  # 1 + 4 padded
    sampled = LinkedPrompt(greedy.turns, "mpic-4", 32, sampling=Sampling(temperature=0.7))
    assert asyncio.run(run(sampled, [5, 6, 7, 2])).answer_agreement is None
    assert engine.lengths[-1] == 0
    assert asyncio.run(run(_prompt("n"), None)).answer_agreement is None
    off = FidelityMonitor(
        FidelityConfig(sample_rate=1.0, idle_s=0.0, answer_tokens=0), engine, lambda: 0, None
    )

    async def run_off():
        p = _prompt("o")
        assert off.wants(p)
        return await off.submit(p, {}, served([5]))

    assert asyncio.run(run_off()).answer_agreement is None
    assert mon.stats()["answer_agreement"] == pytest.approx((0.75 + 1.0 + 5 / 8) / 3)
