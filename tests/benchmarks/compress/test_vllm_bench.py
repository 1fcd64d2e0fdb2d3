"""`mpic bench compress --engine vllm` through the `Engine` protocol (`AsyncVllmEngine` driven by
the offline benchmark's `Driver`, by the reference engine's measuring code: `run_compress`) on
both 1-D RoPE tiny families: every step's log-probs cover the whole vocabulary (a distribution
whose argmax is the greedy token), the rows' prompts are shorter by exactly the tokens each press
dropped and their KV bytes are vLLM's blocks."""

from __future__ import annotations

import math

import pytest
import torch

from mpic.presses.base import keep_count
from mpic.prompt_parts import ImageRef

pytestmark = pytest.mark.slow

BUDGET = 0.3
POLICY = "mpic-4"
BLOCK = 32


@pytest.fixture(scope="module")
def bench(tiny_models_root, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN001, ANN201
    """LLaVA-NeXT (anyres: the long images) only: each engine start costs the suite ~30 s, and
    the presses' own tests run both families."""
    pytest.importorskip("vllm")
    from mpic.benchmarks.compress.vllm_bench import VllmCompressBench
    from mpic.engine.vllm.async_engine import AsyncVllmEngine
    from tests.fixtures.models import _tiny_dir, press_vllm_config

    model_dir = _tiny_dir(tiny_models_root, "llava-next")
    store_dir = tmp_path_factory.mktemp("vllm-bench-store")
    # max_logprobs -1: the benchmark's per-step distributions
    cfg = press_vllm_config(model_dir, store_dir, block_size=BLOCK, max_logprobs=-1)
    bench = VllmCompressBench(engine=AsyncVllmEngine(cfg))
    yield bench
    bench.close()


def test_each_step_is_a_full_vocabulary_distribution(bench) -> None:  # noqa: ANN001
    (parts,) = bench.prompts(1, 1)
    run = bench.run(parts, POLICY, 4)
    assert len(run["tokens"]) == len(run["logits"]) == 4
    for token, logprobs in zip(run["tokens"], run["logits"], strict=True):
        assert logprobs.shape == (bench.spec.vocab_size,)
        assert bool(torch.isfinite(logprobs).all())  # every token, not a top-k
        assert float(torch.logsumexp(logprobs.double(), 0)) == pytest.approx(0.0, abs=1e-3)
        assert int(logprobs.argmax()) == token  # greedy


def test_rows(bench) -> None:  # noqa: ANN001
    from mpic.benchmarks.compress.rows import run_compress

    (parts,) = prompts = bench.prompts(1, 2)  # LLaVA-NeXT's anyres images are long
    images = [bench.entries[p.entry_id] for p in parts if isinstance(p, ImageRef)]
    rows = run_compress(bench, prompts, POLICY, ["elastic", "snapkv"], [1.0, BUDGET], 4)
    assert [(r["press"], r["budget"]) for r in rows] == [
        ("none", 1.0),
        ("elastic", BUDGET),
        ("snapkv", BUDGET),
    ]
    saved = sum(e.num_tokens - keep_count(BUDGET, e.num_tokens) for e in images)
    n_full = rows[0]["prompt_tokens"]
    spec = bench.spec
    token_bytes = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 4
    for r in rows[1:]:
        n = r["prompt_tokens"]
        assert n == n_full - saved
        assert r["kv_bytes"] == math.ceil((n + 4) / BLOCK) * BLOCK * token_bytes
        assert r["kv_bytes_full"] == math.ceil((n_full + 4) / BLOCK) * BLOCK * token_bytes
        assert r["kv_reduction"] == pytest.approx(1 - r["kv_bytes"] / r["kv_bytes_full"])
        assert 0 <= r["token_agreement"] <= 1 and r["kl_mean"] >= 0
        assert r["decode_ms_per_token"] >= 0
