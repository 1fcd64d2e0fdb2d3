"""`mpic bench fidelity --exact-decode` (benchmarks/fidelity/answers.py) on the tiny random
LLaVA: each policy's answer is its first token, then full prefill's continuation after it (the
engines' two-pass flow); KL stays the policy's; the rows say how they were decoded. The answers
come through the `Engine` protocol (`Answers`), equal to the runner's own."""

from __future__ import annotations

import pytest

from mpic.benchmarks.fidelity.answers import Answers
from mpic.benchmarks.fidelity.bench import run_fidelity
from mpic.prompt_parts import ImageRef
from mpic.samples import synthetic_png


@pytest.fixture(scope="module")
def engine(tiny_llava_dir):
    from mpic.engine.hf.engine import ReferenceEngine

    return ReferenceEngine.load(str(tiny_llava_dir))


def test_greedy_answer_is_the_first_token_then_full_prefills(engine) -> None:
    answers = Answers(engine)
    runner = engine.runner
    ids = [answers.add_image(synthetic_png(i, size=80)) for i in range(2)]
    parts = ["see", ImageRef(ids[0]), "and", ImageRef(ids[1]), "which is darker?"]
    plain = answers.answer(parts, "full-reuse", 10)
    exact = answers.answer(parts, "full-reuse", 10, exact_decode=True)
    # the protocol's answer is the runner's, its first-token logits and counts the prefill's
    gen = runner.generate(parts, "full-reuse", 10)
    assert plain.tokens == gen.tokens and plain.logits.equal(gen.prefilled.logits)
    assert plain.prefill.recomputed_tokens == gen.prefilled.recomputed_tokens
    assert plain.prefill.prompt_tokens == gen.prefilled.plan.num_tokens
    assert exact.tokens[0] == plain.tokens[0] and exact.logits.equal(plain.logits)
    assert exact.prefill.recomputed_tokens == plain.prefill.recomputed_tokens  # the policy's
    picks = [exact.tokens[0]]
    forced = runner.stream(
        parts, "full", 10, pick=lambda lg: picks.pop() if picks else int(lg.argmax())
    )
    assert exact.tokens == [t for t, _ in forced]
    full = answers.answer(parts, "full", 10, exact_decode=True)
    assert full.tokens == runner.generate(parts, "full", 10).tokens
    answers.close()


def test_rows_with_exact_decode(engine) -> None:
    policies = ["full", "mpic-4", "full-reuse"]
    plain = run_fidelity(engine, [2], policies, 2, items="images")
    exact = run_fidelity(engine, [2], policies, 2, items="images", exact_decode=True)
    for a, b in zip(plain, exact, strict=True):
        assert a["policy"] == b["policy"] and a["kl_first"] == pytest.approx(b["kl_first"])
        assert a["exact_decode"] is False and b["exact_decode"] is True
    assert exact[0]["agreement_32"] == 1.0
    # a bare reference runner (the tests' shared one) is wrapped as its engine: the same rows
    again = run_fidelity(engine.runner, [2], policies, 2, items="images")
    assert [r["kl_first"] for r in again] == [r["kl_first"] for r in plain]
