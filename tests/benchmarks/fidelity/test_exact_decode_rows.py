"""`mpic bench fidelity --exact-decode` (benchmarks/fidelity/answers.py) on the tiny random
LLaVA: each policy's answer is its first token, then full prefill's continuation after it (the
engines' two-pass flow); KL stays the policy's; the rows say how they were decoded."""

from __future__ import annotations

import pytest

from mpic.benchmarks.fidelity.answers import greedy_answer
from mpic.benchmarks.fidelity.bench import run_fidelity
from mpic.prompt_parts import ImageRef
from mpic.samples import synthetic_png


@pytest.fixture(scope="module")
def runner(tiny_llava_dir):
    from mpic.engine.hf.reference_runner import ReferenceRunner

    return ReferenceRunner(str(tiny_llava_dir))


def test_greedy_answer_is_the_first_token_then_full_prefills(runner) -> None:
    ids = [runner.cache_image(synthetic_png(i, size=80)).entry_id for i in range(2)]
    parts = ["see", ImageRef(ids[0]), "and", ImageRef(ids[1]), "which is darker?"]
    plain = greedy_answer(runner, parts, "full-reuse", 10)
    exact = greedy_answer(runner, parts, "full-reuse", 10, exact_decode=True)
    assert exact.tokens[0] == plain.tokens[0]
    assert exact.prefilled.recomputed_tokens == plain.prefilled.recomputed_tokens  # the policy's
    picks = [exact.tokens[0]]
    forced = runner.stream(
        parts, "full", 10, pick=lambda lg: picks.pop() if picks else int(lg.argmax())
    )
    assert exact.tokens == [t for t, _ in forced]
    full = greedy_answer(runner, parts, "full", 10, exact_decode=True)
    assert full.tokens == runner.generate(parts, "full", 10).tokens


def test_rows_with_exact_decode(runner) -> None:
    policies = ["full", "mpic-4", "full-reuse"]
    plain = run_fidelity(runner, [2], policies, 2, items="images")
    exact = run_fidelity(runner, [2], policies, 2, items="images", exact_decode=True)
    for a, b in zip(plain, exact, strict=True):
        assert a["policy"] == b["policy"] and a["kl_first"] == pytest.approx(b["kl_first"])
        assert a["exact_decode"] is False and b["exact_decode"] is True
    assert exact[0]["agreement_32"] == 1.0
