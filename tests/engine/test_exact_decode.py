"""Exact decoding (`GenerateRequest.exact_decode`, `mpic.engine.request_flow.decode_steps`): the
policy's pass gives the first token, then the prompt and that token are prefilled under `full`
and decoding goes on over the exact KV. Checked on the reference backend with images (tiny
LLaVA) and on the fake backend: the first token is the policy's, every later token is what full
prefill decodes after it (an independent path: the runner's own stream under `full` with the
first pick forced), usage comes from the policy's pass, a continuation needs `full`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from mpic.engine.protocol import GenerateRequest, Sampling
from mpic.engine.request_flow import decoded_ids, generate
from mpic.prompt_parts import ImageRef
from mpic.samples import synthetic_png


@pytest.fixture(scope="module")
def reference(tiny_llava_dir: Path):
    from mpic.engine.hf.engine import ReferenceEngine
    from mpic.engine.hf.reference_runner import ReferenceRunner

    runner = ReferenceRunner(str(tiny_llava_dir))
    ids = [runner.cache_image(synthetic_png(i, size=64 + 16 * i)).entry_id for i in range(3)]
    parts: list = ["Look at these."]
    for n, entry_id in enumerate(ids):
        parts += [ImageRef(entry_id), f"Picture {n}."]
    return ReferenceEngine(runner), [*parts, "Which is the reddest?"]


def _forced_full(runner, parts, first: int, n: int) -> list[int]:
    """Full prefill's greedy tokens after `first` (forced as the first pick)."""
    picks = [first]

    def pick(logits):
        return picks.pop() if picks else int(logits.argmax())

    return [t for t, _ in runner.stream(parts, "full", n, pick=pick, stop_at_eos=False)]


@pytest.mark.parametrize("policy", ["auto", "mpic-2", "full-reuse"])
def test_first_token_is_the_policys_and_the_rest_is_full_prefills(reference, policy) -> None:
    engine, parts = reference
    runner = engine.runner
    one_pass = runner.generate(parts, policy, max_new_tokens=12, stop_at_eos=False).tokens
    request = GenerateRequest(
        parts,
        dict(runner.entries),
        policy,
        Sampling(ignore_eos=True),
        max_tokens=12,
        exact_decode=True,
    )
    tokens, prefill = asyncio.run(decoded_ids(engine, request))
    assert tokens[0] == one_pass[0]
    assert tokens == _forced_full(runner, parts, tokens[0], 12)
    assert prefill.cached_tokens > 0  # usage is the policy's pass: its linked tokens
    plain = asyncio.run(decoded_ids(engine, GenerateRequest(parts, dict(runner.entries), "full")))
    assert plain[1].cached_tokens == 0


def test_exact_decode_of_full_is_full(reference) -> None:
    engine, parts = reference
    full = engine.runner.generate(parts, "full", max_new_tokens=8, stop_at_eos=False).tokens
    request = GenerateRequest(
        parts, dict(engine.runner.entries), "full", Sampling(ignore_eos=True), 8, exact_decode=True
    )
    assert asyncio.run(decoded_ids(engine, request))[0] == full


def test_done_event_counts_both_passes(reference) -> None:
    engine, parts = reference
    request = GenerateRequest(
        parts, dict(engine.runner.entries), "auto", Sampling(ignore_eos=True), 6, exact_decode=True
    )

    async def events():
        return [e async for e in generate(engine, request)]

    done = asyncio.run(events())[-1]
    assert done.completion_tokens == 6 and done.finish_reason == "length"
    assert done.cached_tokens > 0 and done.prompt_tokens > done.cached_tokens


def test_a_continuation_needs_the_full_policy(reference) -> None:
    engine, parts = reference
    request = GenerateRequest(parts, dict(engine.runner.entries), "auto", continue_from=[5])
    with pytest.raises(ValueError, match="full policy"):
        asyncio.run(decoded_ids(engine, request))


def test_fake_engine_answers_the_same_with_exact_decode() -> None:
    from mpic.deployments.engines.fake_engine import FakeEngine

    engine = FakeEngine("fake-test")
    parts = ["please echo these seven words back now"]
    want = asyncio.run(decoded_ids(engine, GenerateRequest(parts, {}, "auto", max_tokens=10)))
    got = asyncio.run(
        decoded_ids(engine, GenerateRequest(parts, {}, "auto", max_tokens=10, exact_decode=True))
    )
    assert got[0] == want[0] and len(got[0]) > 2


def test_only_the_first_token_of_a_coalesced_first_step_is_kept() -> None:
    """vLLM hands several tokens in one step when its reader lags: the tokens after the first
    were decoded over the approximate KV, so the exact pass continues from the first alone."""
    from types import SimpleNamespace

    from mpic.engine.protocol import Decoded, Prefill
    from mpic.engine.request_flow import decode_steps

    calls: list[GenerateRequest] = []

    class Coalescing:
        spec = SimpleNamespace(end_token_ids=(0,))

        async def decode(self, request):
            calls.append(request)
            first = Prefill(prompt_tokens=3, cached_tokens=2, ttft_s=0.1)
            base = 10 * len(calls)
            yield Decoded([base + 1, base + 2, base + 3], None, first)
            yield Decoded([base + 4])

    async def run():
        request = GenerateRequest(["hi"], {}, "auto", max_tokens=4, exact_decode=True)
        return [s async for s in decode_steps(Coalescing(), request)]

    steps = asyncio.run(run())
    assert [s.token_ids for s in steps] == [[11], [21, 22, 23], [24]]
    assert steps[0].prefill is not None and steps[1].prefill is None
    assert calls[1].continue_from == [11] and calls[1].max_tokens == 3
    assert calls[1].policy == "full" and not calls[1].exact_decode


def test_capture_steps_reports_each_tokens_distribution(reference) -> None:
    """`capture_steps`: per token its logits (`Decoded.captured`), the greedy token their
    argmax, the first the captured first token's; with `exact_decode` across both passes."""
    import dataclasses

    import torch

    engine, parts = reference
    request = GenerateRequest(
        parts,
        dict(engine.runner.entries),
        "mpic-2",
        Sampling(ignore_eos=True),
        max_tokens=5,
        capture_first_token=True,
        capture_steps=True,
    )
    for exact in (False, True):
        captured: list = []
        tokens, prefill = asyncio.run(
            decoded_ids(engine, dataclasses.replace(request, exact_decode=exact), captured)
        )
        assert len(tokens) == 5 and [c.top1 for c in captured] == tokens
        assert torch.equal(captured[0].logits, prefill.first_token.logits)
