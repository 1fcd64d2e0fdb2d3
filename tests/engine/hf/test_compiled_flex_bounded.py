"""The compiled selective pass holds for good: a stream of prompts of varied shapes under every
policy family keeps a bounded set of dynamo graphs (FlexAttention and the layer step) and never
falls to eager (kernels/flex.py, kernels/compiled.py). On the CPU the compiled path runs with
dynamo's `aot_eager` backend (torch 2.13's CPU inductor cannot generate FlexAttention's code),
which guards and recompiles as inductor does; one test compiles the layer step with inductor."""

from __future__ import annotations

import random

import pytest
import torch

from mpic.engine.hf.reference_runner import ReferenceRunner
from mpic.kernels import compiled
from mpic.kernels.compiled import compile_stats
from mpic.kernels.flex import FlexBackend
from mpic.samples import interleaved_prompt, synthetic_png

POLICIES = (
    "full",
    "prefix",
    "full-reuse",
    "cacheblend-15",
    "mpic-8",
    "boundary-4",
    "vlcache-0.1",
    "scout-0.2:i0.8",  # corrected: S 0.8 on these image prompts (the default, 1, corrects none)
    "auto",
)
PROMPTS = 200


@pytest.fixture
def fresh_dynamo(monkeypatch):
    """Dynamo's caches emptied and the fall count zeroed, for this test only."""
    torch._dynamo.reset()
    monkeypatch.setattr(compiled, "_COMPILED", {})
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("family_dir", ["tiny_llava_dir", "tiny_qwen2vl_dir"])
def test_varied_prompts_keep_a_bounded_set_of_graphs(family_dir, request, fresh_dynamo):
    model_dir = request.getfixturevalue(family_dir)
    backend = FlexBackend(
        compile=True, read_indices=False, fused_correction=True, compile_backend="aot_eager"
    )
    runner = ReferenceRunner(
        str(model_dir), attention_backend=backend, compile_layers=True, compile_backend="aot_eager"
    )
    oracle = ReferenceRunner(str(model_dir), attention_backend="sdpa_runs")
    ids = []
    for i in range(16):
        entry = runner.cache_image(synthetic_png(i, size=48 + 8 * (i % 5)))
        oracle.add_entry(entry)
        ids.append(entry.entry_id)
    rng = random.Random(0)
    graphs_at_half = None
    with torch.inference_mode():
        for n in range(PROMPTS):
            policy = POLICIES[n % len(POLICIES)]
            parts = interleaved_prompt(rng.sample(ids, rng.randint(1, 16)))
            parts = ["word " * rng.randint(0, 60), *parts]
            got = runner.prefill(parts, policy, 2)
            if n % 20 == 0:  # the compiled path answers as the oracle backend does
                want = oracle.prefill(parts, policy, 2)
                torch.testing.assert_close(got.logits, want.logits, atol=2e-4, rtol=1e-4)
            if n == PROMPTS // 2:
                graphs_at_half = compile_stats()["graphs"]
    stats = compile_stats()
    assert stats["eager_falls"] == 0, stats["last_fall"]
    assert stats["graphs"] is not None, stats["by_function"]
    flex_graphs = stats["by_function"]["flex_attention"]["graphs"]
    # two mask rules (plain, kept) x (plain, log-sum-exp) calls, plus a recompile or two when
    # dynamo's first graph had equal query and key block counts; far below the limit of 8
    assert 2 <= flex_graphs <= 6
    for step in ("_attention_inputs_step", "_output_and_mlp_step"):
        # one graph for every layer and token count >= 2, one for a single token
        assert 1 <= stats["by_function"][step]["graphs"] <= 2
    assert stats["by_function"]["merge_groups"]["graphs"] <= 4  # per S value (two halves)
    assert stats["graphs"] == graphs_at_half  # nothing new after the first hundred prompts


@pytest.mark.slow
def test_the_inductor_compiled_layer_step_equals_the_eager_one(tiny_llava_dir, fresh_dynamo):
    """The layer step compiled by inductor (C++ on the CPU, Triton on CUDA) gives the eager
    step's logits and greedy tokens under the default policy."""
    eager = ReferenceRunner(str(tiny_llava_dir), compile_layers=False)
    fused = ReferenceRunner(str(tiny_llava_dir), compile_layers=True)
    ids = []
    for i in range(3):
        entry = eager.cache_image(synthetic_png(i, size=64))
        fused.add_entry(entry)
        ids.append(entry.entry_id)
    parts = interleaved_prompt(ids)
    for policy in ("full", "auto"):
        want, got = eager.generate(parts, policy, 6), fused.generate(parts, policy, 6)
        torch.testing.assert_close(
            got.prefilled.logits, want.prefilled.logits, atol=1e-4, rtol=1e-4
        )
        assert got.tokens == want.tokens
    assert compile_stats()["failed"] == {}


def test_a_recompile_limit_hit_is_counted_logged_and_answered(fresh_dynamo, caplog):
    """Past dynamo's limit the call runs eagerly, and says so (count, one log line, reason)."""
    with torch._dynamo.config.patch(recompile_limit=1):
        backend = FlexBackend(compile=True, read_indices=False, compile_backend="aot_eager")
        g = torch.Generator().manual_seed(0)
        outs = []
        for heads in (2, 4, 8):  # each head count is a new graph: the second one hits the limit
            index = torch.arange(0, 300, 2)
            q = torch.randn(index.numel(), heads, 16, generator=g)
            k, v = torch.randn(300, 2, 16, generator=g), torch.randn(300, 2, 16, generator=g)
            with caplog.at_level("WARNING", logger="mpic.kernels.compiled"):
                outs.append(backend.attend(backend.prepare(index, 300), q, k, v))
            eager = FlexBackend(compile=False)
            torch.testing.assert_close(outs[-1], eager.attend(eager.prepare(index, 300), q, k, v))
    stats = compile_stats()
    assert stats["eager_falls"] == 2
    assert "recompile limit" in stats["last_fall"].lower()
    falls = [r for r in caplog.records if "recompile limit" in r.getMessage()]
    assert len(falls) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("family_dir", ["tiny_llava_dir", "tiny_qwen2vl_dir"])
def test_on_cuda_the_inductor_compiled_pass_stays_bounded(family_dir, request, fresh_dynamo):
    """As on a served GPU: the CUDA defaults (compiled FlexAttention, fused correction and
    compiled layer step, all by inductor) over 60 varied prompts under every policy family:
    no eager fall, no failed compile, a few graphs, and the CPU oracle's logits (float32, TF32
    off)."""
    model_dir = request.getfixturevalue(family_dir)
    torch.backends.cuda.matmul.allow_tf32 = False
    runner = ReferenceRunner(str(model_dir), device="cuda")
    oracle = ReferenceRunner(str(model_dir), attention_backend="sdpa_runs")
    assert runner.adapter.compiled
    ids = []
    for i in range(16):
        entry = oracle.cache_image(synthetic_png(i, size=48 + 8 * (i % 5)))
        runner.add_entry(entry)  # linking moves its K/V to the runner's device
        ids.append(entry.entry_id)
    rng = random.Random(1)
    with torch.inference_mode():
        for n in range(60):
            policy = POLICIES[n % len(POLICIES)]
            chosen = rng.sample(ids, rng.randint(1, 16))
            parts = ["word " * rng.randint(0, 60), *interleaved_prompt(chosen)]
            got = runner.prefill(parts, policy, 2)
            if n % 10 == 0:
                want = oracle.prefill(parts, policy, 2)
                torch.testing.assert_close(got.logits.cpu(), want.logits, atol=2e-3, rtol=2e-3)
    stats = compile_stats()
    assert stats["eager_falls"] == 0, stats["last_fall"]
    assert stats["failed"] == {}, stats["failed"]
    assert stats["by_function"]["flex_attention"]["graphs"] <= 6, stats["by_function"]
