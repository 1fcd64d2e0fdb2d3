"""Presses (mpic.presses) on synthetic tensors and on the tiny VLMs through the reference runner.

Checks: each press keeps exactly its budget per layer (MEDA: its Eq. 7 allocation, summing to the
uniform total); budget 1.0 is bit-identical to no press; merging preserves each bucket's mean;
the observer's attention sums equal transformers' own eager attention; decoding over an
uncompressed CompressedKV equals dense decoding; presses compose with every linking policy;
Elastic Cache's elimination holds the retention ratio.
"""

from __future__ import annotations

import io

import pytest
import torch

from mpic.engine.hf.reference_runner import ReferenceRunner
from mpic.linker.prompt import ImageRef
from mpic.linker.selective_prefill import run_layers
from mpic.presses.base import keep_count, merge_into, top_indices
from mpic.presses.cache import CompressedKV
from mpic.presses.elastic_cache import nearest_anchor_buckets
from mpic.presses.meda import allocate
from mpic.presses.registry import PRESSES, check_budget, get_press

NAMES = list(PRESSES)
POLICIES = ["full", "prefix", "full-reuse", "cacheblend-15", "mpic-4", "boundary-4", "vlcache-0.5"]


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module", params=["llava", "qwen2-vl"])
def runner(request, tiny_models_root, sample_images):
    from tests.fixtures.models import _tiny_dir

    r = ReferenceRunner(str(_tiny_dir(tiny_models_root, request.param)))
    ids = [r.cache_image(_png(img)).entry_id for img in sample_images[:2]]
    r.test_parts = ["Look at", ImageRef(ids[0]), "and then", ImageRef(ids[1]), "describe both."]
    return r


# ---- registry and budgets -------------------------------------------------------------------


def test_registry_rejects_unknown_press_listing_names():
    with pytest.raises(ValueError, match="known: elastic, mm-shiftkv, meda, window, snapkv"):
        get_press("h2o")


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.01])
def test_budget_outside_unit_interval_rejected(bad):
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        check_budget(bad)
    with pytest.raises(ValueError):
        keep_count(bad, 10)


def test_runner_rejects_bad_press_before_work(runner):
    with pytest.raises(ValueError, match="unknown press"):
        runner.generate(runner.test_parts, "mpic-4", 2, press="nope", budget=0.5)
    with pytest.raises(ValueError, match="budget"):
        runner.generate(runner.test_parts, "mpic-4", 2, press="meda", budget=1.5)


# ---- merging and selection on synthetic tensors ---------------------------------------------


def test_merge_preserves_bucket_means():
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 20, 4, generator=gen), torch.randn(2, 20, 4, generator=gen)
    kept = torch.tensor([1, 7, 15])
    target = torch.randint(0, 3, (2, 20), generator=gen)
    target[:, kept] = torch.arange(3)
    mk, mv = merge_into(keys, values, target, kept)
    for h in range(2):
        for slot in range(3):
            members = target[h] == slot
            torch.testing.assert_close(mk[h, slot], keys[h, members].mean(0))
            torch.testing.assert_close(mv[h, slot], values[h, members].mean(0))
    # the size-weighted mean of the merged cache is the mean of the whole prompt
    sizes = torch.stack([torch.bincount(target[h], minlength=3) for h in range(2)]).float()
    torch.testing.assert_close((mv * sizes[..., None]).sum(1) / 20, values.mean(1))


def test_elastic_buckets_follow_eq2():
    anchors = torch.tensor([0, 4, 9, 19])
    b = nearest_anchor_buckets(anchors, 20)
    # B_1 = {0..floor((0+4)/2)=2}, B_2 = {3..floor((4+9)/2)=6}, B_3 = {7..14}, B_4 = {15..19}
    expected = [0] * 3 + [1] * 4 + [2] * 8 + [3] * 5
    assert b.tolist() == expected


def test_top_indices_keeps_forced_and_orders():
    s = torch.tensor([5.0, 1.0, 9.0, 3.0, 0.0])
    forced = torch.tensor([False, False, False, False, True])
    assert top_indices(s, 3, forced).tolist() == [0, 2, 4]


def test_meda_allocation_sums_and_caps():
    w = torch.tensor([0.7, 0.2, 0.05, 0.05])
    out = allocate(w, total=40, cap=20)
    assert sum(out) == 40 and max(out) <= 20 and min(out) >= 1
    assert out[0] == 20  # capped; the excess goes to the others in proportion
    assert out[1] > out[2]


# ---- on the tiny VLMs -------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("budget", [0.5, 0.2])
def test_keeps_exactly_its_budget_per_layer(runner, name, budget):
    pre = runner.prefill(runner.test_parts, "mpic-4", 4, press=name, budget=budget)
    kv = pre.kv
    assert isinstance(kv, CompressedKV)
    n, L = pre.plan.num_tokens, runner.adapter.num_layers
    c = keep_count(budget, n)
    if name == "meda":  # Eq. 7: per-layer sizes, same total
        assert sum(kv.prompt_lengths) == c * L
        assert all(1 <= x <= n for x in kv.prompt_lengths)
    else:
        assert kv.prompt_lengths == [c] * L
    for layer in range(L):
        assert kv.keys[layer].shape[1] == kv.prompt_lengths[layer] + 4  # the dense KV is gone
    assert kv.nbytes() < 2 * L * (n + 4) * runner.adapter.num_kv_heads * runner.adapter.head_dim * 4


@pytest.mark.parametrize("name", NAMES)
def test_budget_one_is_bit_identical_to_no_press(runner, name):
    ref = runner.generate(runner.test_parts, "mpic-4", 6, stop_at_eos=False)
    got = runner.generate(runner.test_parts, "mpic-4", 6, stop_at_eos=False, press=name, budget=1.0)
    assert got.tokens == ref.tokens
    assert torch.equal(got.prefilled.logits, ref.prefilled.logits)
    assert got.prefilled.press is None


def test_decode_over_uncompressed_compressed_kv_equals_dense(runner):
    """CompressedKV's decode attention is exact: keep every prompt token, decode 4 steps."""
    a, steps = runner.adapter, 4
    pre = runner.prefill(runner.test_parts, "full", steps)
    n = pre.plan.num_tokens
    ckv = CompressedKV(
        [pre.kv.keys[layer, :n].transpose(0, 1).clone() for layer in range(a.num_layers)],
        [pre.kv.values[layer, :n].transpose(0, 1).clone() for layer in range(a.num_layers)],
        steps,
    )
    pos0 = int(pre.plan.positions.max()) + 1
    token = int(pre.logits.argmax())
    for step in range(steps):
        pos = torch.tensor([pos0 + step])
        if pre.plan.positions.dim() == 2:
            pos = pos.expand(3, 1)
        outs = []
        for kv in (pre.kv, ckv):
            with torch.inference_mode():
                h, _, _ = run_layers(
                    a,
                    kv,
                    a.embed_tokens(torch.tensor([token])),
                    torch.tensor([n + step]),
                    pos,
                    torch.tensor([a.num_layers]),
                )
                outs.append(a.logits(h)[0])
        torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)
        token = int(outs[0].argmax())


def test_observer_attention_sums_equal_transformers_eager(runner, sample_images):
    """Under `full`, LayerStats.colsum (Elastic Eq. 1's sum_m A_{m,n}, MEDA Eq. 8) equals the
    column sums of transformers' own eager attention weights, head-averaged per KV head."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    from mpic.engine.hf.compress import observed, observer_for
    from mpic.linker.kv.dense import DenseLinkedKV
    from mpic.linker.pipeline import link_and_prefill

    planned = runner.plan(runner.test_parts, "full")
    a, plan = runner.adapter, planned.plan
    kv = DenseLinkedKV(a.num_layers, plan.num_tokens, a.num_kv_heads, a.head_dim)
    obs = observer_for(plan, a)
    oa, okv = observed(a, kv, obs)
    with torch.inference_mode():
        link_and_prefill(oa, planned, okv)

    cfg = AutoConfig.from_pretrained(runner.spec.path)
    cls = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(cfg)]
    eager = cls.from_pretrained(runner.spec.path, attn_implementation="eager").eval()
    tok = runner.processor.tokenizer
    content = [
        {"type": "image"} if isinstance(p, ImageRef) else {"type": "text", "text": p}
        for p in runner.test_parts
    ]
    text = tok.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    inputs = runner.processor(text=text, images=sample_images[:2], return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == plan.token_ids.tolist()
    with torch.inference_mode():
        att = eager(**inputs, output_attentions=True).attentions
    group = a.num_heads // a.num_kv_heads
    for layer in range(a.num_layers):
        col = att[layer][0].float().sum(1)  # [H, N]
        want = col.view(a.num_kv_heads, group, -1).mean(1)
        torch.testing.assert_close(obs.layers[layer].colsum, want, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(
            obs.layers[layer].last_probs,
            att[layer][0, :, -1].float().view(a.num_kv_heads, group, -1).mean(1),
            atol=1e-5,
            rtol=1e-4,
        )


def test_window_keeps_sinks_and_recent_exactly(runner):
    ref = runner.prefill(runner.test_parts, "mpic-4", 1)
    pre = runner.prefill(runner.test_parts, "mpic-4", 1, press="window", budget=0.5)
    n = ref.plan.num_tokens
    c = keep_count(0.5, n)
    idx = torch.cat([torch.arange(4), torch.arange(n - (c - 4), n)])
    for layer in range(runner.adapter.num_layers):
        want = ref.kv.keys[layer, idx].transpose(0, 1)
        assert torch.equal(pre.kv.keys[layer][:, :c], want)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("policy", POLICIES)
def test_presses_compose_with_every_linking_policy(runner, name, policy):
    """link -> recompute -> compress -> decode: the first token is the prefill's (compression
    comes after it), the KV is compressed to the budget, decoding runs over it."""
    ref = runner.generate(runner.test_parts, policy, 3, stop_at_eos=False)
    got = runner.generate(runner.test_parts, policy, 3, stop_at_eos=False, press=name, budget=0.3)
    assert got.tokens[0] == ref.tokens[0]
    assert len(got.tokens) == 3
    kv = got.prefilled.kv
    n, L = got.prefilled.plan.num_tokens, runner.adapter.num_layers
    assert sum(kv.prompt_lengths) == keep_count(0.3, n) * L


def test_elastic_elimination_holds_the_retention_ratio(runner):
    steps = 40
    g = runner.generate(
        runner.test_parts, "mpic-4", steps, stop_at_eos=False, press="elastic", budget=0.3
    )
    kv, n = g.prefilled.kv, g.prefilled.plan.num_tokens
    seen = n + steps - 1  # the last token's K/V is never computed
    c = keep_count(0.3, n)
    assert kv.lengths == [kv.lengths[0]] * len(kv.lengths)
    assert kv.lengths[0] <= max(c, 0.3 * seen) + 1
    assert kv.lengths[0] < c + steps - 1  # something was eliminated


def test_mm_shiftkv_is_deterministic_and_per_head(runner):
    a = runner.prefill(runner.test_parts, "mpic-4", 1, press="mm-shiftkv", budget=0.3)
    b = runner.prefill(runner.test_parts, "mpic-4", 1, press="mm-shiftkv", budget=0.3)
    for layer in range(runner.adapter.num_layers):
        assert torch.equal(a.kv.keys[layer], b.kv.keys[layer])
