"""Teacher forcing through the engine protocol (`GenerateRequest.forced_ids`, the compression
benchmark's teacher-forced KL) and the KV bytes a backend reports (`Prefill.kv_bytes`). On the
reference backend (tiny LLaVA): the forced ids come back in order, each captured distribution is
the one an independent path (the runner's own stream with the same picks forced) decodes, the
engine picks its own after them (also across `exact_decode`'s two passes), the logprob
reported is the forced token's; the dense KV's bytes are L * 2 * (prompt + max_tokens) * H_kv *
D * 4. The fake engine refuses forced ids (400)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from mpic.engine.protocol import GenerateRequest, Sampling
from mpic.engine.request_flow import decoded_ids
from mpic.errors import InvalidRequestError
from mpic.prompt_parts import ImageRef
from mpic.samples import synthetic_png

STEPS = 6


@pytest.fixture(scope="module")
def reference(tiny_llava_dir: Path):
    from mpic.engine.hf.engine import ReferenceEngine
    from mpic.engine.hf.reference_runner import ReferenceRunner

    runner = ReferenceRunner(str(tiny_llava_dir))
    ids = [runner.cache_image(synthetic_png(i)).entry_id for i in range(2)]
    parts = ["Look.", ImageRef(ids[0]), "And.", ImageRef(ids[1]), "Which is redder?"]
    request = GenerateRequest(
        parts, dict(runner.entries), "mpic-4", Sampling(ignore_eos=True), STEPS, capture_steps=True
    )
    return ReferenceEngine(runner), request


def _runner_forced(runner, request: GenerateRequest, forced: list[int], **press):
    """(tokens, logits) of the runner's own stream with the first picks forced."""
    logits: list[torch.Tensor] = []

    def pick(lg: torch.Tensor) -> int:
        logits.append(lg.detach().float().cpu())
        n = len(logits) - 1
        return forced[n] if n < len(forced) else int(lg.argmax())

    stream = runner.stream(
        request.parts, request.policy, request.max_tokens, stop_at_eos=False, pick=pick, **press
    )
    return [t for t, _ in stream], logits


@pytest.mark.parametrize("press", [{}, {"press": "snapkv", "budget": 0.5}])
def test_forced_ids_come_back_with_the_distributions_they_replaced(reference, press) -> None:
    engine, request = reference
    request = dataclasses.replace(request, **press)
    free, _ = asyncio.run(decoded_ids(engine, request))
    forced = [(t + 1) % engine.spec.vocab_size for t in free[:4]]  # not the greedy tokens
    captured: list = []
    tokens, _ = asyncio.run(
        decoded_ids(engine, dataclasses.replace(request, forced_ids=forced), captured)
    )
    want_tokens, want_logits = _runner_forced(engine.runner, request, forced, **press)
    assert tokens[:4] == forced and tokens == want_tokens  # then its own greedy picks
    assert len(captured) == STEPS
    for got, want in zip(captured, want_logits, strict=True):
        assert torch.equal(got.logits, want)


def test_forcing_the_greedy_tokens_changes_nothing(reference) -> None:
    engine, request = reference
    free_captured: list = []
    free, _ = asyncio.run(decoded_ids(engine, request, free_captured))
    captured: list = []
    tokens, _ = asyncio.run(
        decoded_ids(engine, dataclasses.replace(request, forced_ids=free), captured)
    )
    assert tokens == free
    assert all(
        torch.equal(a.logits, b.logits) for a, b in zip(captured, free_captured, strict=True)
    )


def test_forced_token_logprob_and_exact_decode(reference) -> None:
    engine, request = reference
    forced = [3, 4, 5]
    request = dataclasses.replace(
        request, forced_ids=forced, sampling=Sampling(ignore_eos=True, logprobs=0)
    )

    async def steps():
        from mpic.engine.request_flow import decode_steps

        return [s async for s in decode_steps(engine, request)]

    first = asyncio.run(steps())
    assert [s.token_ids[0] for s in first][:3] == forced
    for step in first[:3]:
        logp = torch.log_softmax(step.captured[0].logits, -1)
        assert step.logprobs[0].logprob == pytest.approx(float(logp[step.token_ids[0]]), abs=1e-5)
    # exact decoding: the second pass (full, over prompt + first token) is forced on the rest
    tokens, _ = asyncio.run(decoded_ids(engine, dataclasses.replace(request, exact_decode=True)))
    assert tokens[:3] == forced and len(tokens) == STEPS


def test_dense_kv_bytes(reference, tiny_llava_dir: Path) -> None:
    engine, request = reference
    _, prefill = asyncio.run(decoded_ids(engine, request))
    cfg = json.loads((tiny_llava_dir / "config.json").read_text())["text_config"]
    layers, h_kv = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert prefill.kv_bytes == 2 * layers * (prefill.prompt_tokens + STEPS) * h_kv * d * 4


def test_fake_engine_refuses_forced_ids() -> None:
    from mpic.deployments.engines.fake_engine import FakeEngine

    request = GenerateRequest(["echo me"], {}, "full", max_tokens=2, forced_ids=[1])
    with pytest.raises(InvalidRequestError, match="teacher-force"):
        asyncio.run(decoded_ids(FakeEngine("fake-test"), request))
