"""`scout-<b>[:s<S>][:i<S>][:k<K>][:d<tau>]` on the toy decoder: names, the budget and boundary
tokens it selects (scores weighed by the offset prior), the scout's scores against attention
recomputed from an mpic-0 pass (the state the scout sees), exactness with everything recomputed,
the correction off (S = 1) equal to a plain plan with the same depths, and the S of prompts whose
items are mostly images."""

import dataclasses
import math

import pytest
import torch

from mpic.linker.kv.dense import DenseLinkedKV
from mpic.linker.pipeline import link_and_prefill
from mpic.linker.plan import build_plan, resolve_entries, unique_entries
from mpic.linker.policies import get_policy
from mpic.linker.policies import scout as scout_module
from mpic.linker.policies.base import Policy
from mpic.linker.policies.scout import (
    IMAGE_SCALE,
    OFFSET_TAU,
    ScoutPolicy,
    boundary_mask,
    mostly_images,
    offset_prior,
    scout_layers,
)
from mpic.linker.recipe import with_policy
from mpic.linker.scout import scoring_rows, scout_scores
from tests.linker.toy_model import (
    CONTEXT,
    IMAGE_ID,
    ToyAdapter,
    reference_forward,
    toy_entries,
    toy_spec,
)

L = 4
PROMPT = CONTEXT + [10, 11, IMAGE_ID, 12, IMAGE_ID, 13, IMAGE_ID, 14, 15, 16]
REFS = ["img-a", "img-b", "img-a"]


def _setup(mrope=False):
    adapter = ToyAdapter(mrope=mrope, num_layers=L)
    items = resolve_entries(REFS, toy_entries(adapter))
    plan = build_plan(toy_spec(adapter), PROMPT, items)
    return adapter, plan, unique_entries(plan, items)


def _run(adapter, plan, entries, policy):
    kv = DenseLinkedKV(adapter.num_layers, plan.num_tokens, 2, 8)
    return link_and_prefill(adapter, with_policy(plan, entries, policy, L), kv), kv


class _Fixed(Policy):
    """Given depths (to compare a scout's selection with a plain plan)."""

    def __init__(self, depth):
        self.depth, self.name = depth, "fixed"

    def depths(self, plan, entries, num_layers):
        return self.depth


def test_names_auto_and_bad_names():
    assert get_policy("scout-0.2:s0.8").name == "scout-0.2:s0.8"
    assert get_policy("scout-0.25:s1").name == "scout-0.25:s1"
    assert get_policy("scout-0.2").name.startswith("scout-0.2:s")  # S from the default table
    assert get_policy("auto", budget=0.3).name == get_policy("scout-0.3").name
    assert get_policy("auto-0.1").name == get_policy("scout-0.1").name
    for bad in ("scout-1.5", "scout-x", "scout-0.2:t0.8", "scout-0.2:s0", "auto-2"):
        with pytest.raises(ValueError, match="valid:"):
            get_policy(bad)
    assert scout_layers(30) == list(range(2, 6))
    assert scout_layers(4) == [1]
    # S per half of the layers: spelled first/second, canonical when equal
    assert get_policy("scout-0.2:s0.9/0.8").name == "scout-0.2:s0.9/0.8"
    assert get_policy("scout-0.2:s0.8/0.8").name == "scout-0.2:s0.8"
    assert get_policy("scout-0.2").name == "scout-0.2:s0.975/0.85"  # the default table at 20%
    assert get_policy("auto").name == "scout-0.18:s0.975/0.85"  # DEFAULT_BUDGET
    for bad in ("scout-0.2:s0.9/0", "scout-0.2:s0.9/x", "scout-0.2:s/0.8"):
        with pytest.raises(ValueError, match="valid:"):
            get_policy(bad)


def test_boundary_and_offset_prior_fields_of_the_name():
    """`:k<K>` (boundary tokens per item) and `:d<tau>` (the offset prior) after S, spelled only
    when not the default, in that order; every canonical name parses to itself."""
    default = get_policy("scout-0.2")
    assert (default.sinks, default.offset_tau) == (1, OFFSET_TAU)
    named = get_policy("scout-0.2:s0.9/0.8:k8:d0")
    assert (named.sinks, named.offset_tau) == (8, 0.0)
    assert named.name == "scout-0.2:s0.9/0.8:k8:d0"
    assert get_policy("scout-0.2:k8").name == "scout-0.2:s0.975/0.85:k8"  # S from the table
    assert get_policy("scout-0.2:s0.8:k1:d8").name == "scout-0.2:s0.8"  # the defaults
    assert get_policy("scout-0.2:s0.8:d4").name == "scout-0.2:s0.8:d4"
    for name in ("auto", "auto-0.3", "scout-0.2:s0.9/0.8:k8", "scout-0.2:s1:k0:d16"):
        spelled = get_policy(name).name
        assert get_policy(spelled).name == spelled
    bad_names = ("scout-0.2:k8:s0.8", "scout-0.2:d8:k8", "scout-0.2:k1.5", "scout-0.2:k-1")
    for bad in (*bad_names, "scout-0.2:dx", "scout-0.2:d-1", "scout-0.2:k8:k8", "scout-0.2:x1"):
        with pytest.raises(ValueError, match="valid:"):
            get_policy(bad)


def test_offset_prior_values():
    _, plan, _ = _setup()
    prior = offset_prior(plan, 8.0)
    item = ~plan.is_text
    want = (1 + plan.source_offset[item].float() / 8) ** -0.5
    torch.testing.assert_close(prior[item], want)
    assert bool((prior[plan.is_text] == 1).all())
    assert bool((offset_prior(plan, 0.0) == 1).all())
    assert float(prior[item].max()) == 1.0  # offset 0


@pytest.mark.parametrize("budget", [0.0, 0.5, 0.7])
@pytest.mark.parametrize(("sinks", "tau"), [(1, OFFSET_TAU), (1, 0.0), (2, 2.0)])
def test_selection_fills_the_budget_with_text_boundaries_then_top_scores(budget, sinks, tau):
    """Text, each occurrence's first `sinks` and last token, then the top scores x the offset
    prior (tau 0: the scores alone)."""
    adapter, plan, entries = _setup()
    policy = ScoutPolicy(budget, scale=1.0, sinks=sinks, offset_tau=tau)
    pre = policy.apply(plan, entries, L)
    scores = torch.rand(plan.num_tokens, generator=torch.Generator().manual_seed(3))
    depth = policy.select(pre, entries, scores, L)
    must = plan.is_text | boundary_mask(plan, entries, sinks)
    must[-1] = True
    assert bool((depth[must] == L).all())
    free = ~must
    room = max(0, round(budget * plan.num_tokens) - int(must.sum()))
    weighted = scores * offset_prior(plan, tau)
    order = weighted[free].argsort(descending=True)[:room]
    want = set(torch.nonzero(free).flatten()[order].tolist())
    got = set(torch.nonzero((depth == L) & free).flatten().tolist())
    assert got == want
    assert set(depth.tolist()) <= {0, L}


def test_the_offset_prior_prefers_an_item_s_leading_tokens():
    """Equal scores: the room goes to the tokens nearest their item's start (lowest offsets)."""
    adapter, plan, entries = _setup()
    policy = ScoutPolicy(0.7, scale=1.0)
    pre = policy.apply(plan, entries, L)
    depth = policy.select(pre, entries, torch.ones(plan.num_tokens), L)
    must = plan.is_text | boundary_mask(plan, entries, 1)
    must[-1] = True
    picked = (depth == L) & ~must
    left = ~must & ~picked & ~plan.is_text
    assert int(picked.sum()) > 0 and int(left.sum()) > 0
    assert int(plan.source_offset[picked].max()) <= int(plan.source_offset[left].min())


def test_scout_scores_equal_attention_recomputed_from_an_mpic0_pass():
    """The scout's state at layer l is mpic-0's (text fresh, items linked): recompute the scoring
    rows' attention from mpic-0's keys and the queries it computed."""
    adapter, plan, entries = _setup()
    captured = {}
    real = adapter.attention_inputs

    def spy(layer, hidden, positions):
        q, k, v = real(layer, hidden, positions)
        captured[layer] = q
        return q, k, v

    adapter.attention_inputs = spy
    out, kv = _run(adapter, plan, entries, "mpic-0")
    text = torch.nonzero(out.plan.recompute_depth > 0).flatten()
    rows = scoring_rows(plan, text)
    layers = [1, 2]
    want = torch.zeros(plan.num_tokens)
    for layer in layers:
        q = captured[layer][rows]  # [R, H, D]
        k = kv.keys[layer].repeat_interleave(2, dim=1)  # [N, H, D]
        scores = torch.einsum("rhd,nhd->hrn", q, k) / math.sqrt(8)
        visible = torch.arange(plan.num_tokens)[None, :] <= text[rows][:, None]
        p = scores.masked_fill(~visible, -math.inf).softmax(-1).mean(0)  # [R, N]
        w = torch.full((rows.numel(),), 0.5 / (rows.numel() - 1))
        w[-1] = 1.0
        want += (p * w[:, None]).sum(0)
    want[plan.is_text] = 0
    adapter.attention_inputs = real
    kv2 = DenseLinkedKV(L, plan.num_tokens, 2, 8)
    from mpic.linker.link import linked_items

    pre = ScoutPolicy(0.5).apply(plan, entries, L)
    items = linked_items(pre, entries, adapter.rope, L, every_item=True)
    items.write_to(kv2)
    got, report = scout_scores(adapter, pre, entries, kv2, layers, items, 0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert report.layers_run == 3 and report.tokens == int(plan.is_text.sum())


@pytest.mark.parametrize("mrope", [False, True])
def test_everything_recomputed_is_exact_under_any_scale(mrope):
    adapter, plan, entries = _setup(mrope)
    embeds = []
    for i in range(plan.num_tokens):
        e = int(plan.source_entry[i])
        if e < 0:
            embeds.append(adapter.embed_tokens(plan.token_ids[i : i + 1]))
        else:
            off = int(plan.source_offset[i])
            embeds.append(entries[e].input_embeds[off : off + 1])
    ref, _, _ = reference_forward(adapter, torch.cat(embeds), plan.positions)
    out, _ = _run(adapter, plan, entries, ScoutPolicy(1.0, scale=0.6))
    assert out.recomputed_tokens == plan.num_tokens
    torch.testing.assert_close(out.result.logits, ref[-1], rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize("mrope", [False, True])
def test_scale_one_equals_a_plain_plan_and_the_correction_changes_logits(mrope):
    adapter, plan, entries = _setup(mrope)
    plain_scout, _ = _run(adapter, plan, entries, ScoutPolicy(0.6, scale=1.0))
    depth = plain_scout.plan.recompute_depth
    assert 0 < int((depth == L).sum()) - int(plan.is_text.sum())
    assert plain_scout.scout is not None and plain_scout.scout.tokens == int(plan.is_text.sum())
    fixed, _ = _run(adapter, plan, entries, _Fixed(depth))
    torch.testing.assert_close(plain_scout.result.logits, fixed.result.logits)
    corrected, kv = _run(adapter, plan, entries, ScoutPolicy(0.6, scale=0.7, image_scale=0.7))
    assert torch.equal(corrected.plan.recompute_depth, depth)  # S does not move the selection
    assert kv.correction is not None and kv.correction.scale == 0.7
    assert (corrected.result.logits - fixed.result.logits).abs().max() > 1e-3


def test_scale_per_half_of_the_layers(monkeypatch):
    """`scout-b:s<S1>/<S2>`: layers below L // 2 attend with S1, the others with S2 (the linked
    KV is handed each layer's S); equal halves are exactly one S. (The documents' S: the toy's
    items are images, read here as documents.)"""
    monkeypatch.setattr(scout_module, "mostly_images", lambda plan, entries: False)
    adapter, plan, entries = _setup()
    seen = {}

    def spy_run(policy):
        out, kv = _run(adapter, plan, entries, policy)
        return out, kv

    uniform, kv_u = spy_run(ScoutPolicy(0.6, scale=0.7))
    same, _ = spy_run(ScoutPolicy(0.6, scale=0.7, late_scale=0.7))
    torch.testing.assert_close(same.result.logits, uniform.result.logits, rtol=0, atol=0)
    halves, kv = spy_run(ScoutPolicy(0.6, scale=1.0, late_scale=0.7))
    corr = kv.correction
    assert corr is not None and corr.split_layer == L // 2
    assert [corr.scale_at(layer) for layer in range(L)] == [1.0, 1.0, 0.7, 0.7]
    real = kv.attention.__call__

    def record(q, q_index, keys, values, linked=None, s=1.0):
        seen[len(seen)] = s
        return real(q, q_index, keys, values, linked=linked, s=s)

    kv.attention = record
    q = torch.randn(1, 4, 8)
    for layer in range(L):
        kv.attend(layer, q, torch.tensor([plan.num_tokens - 1]))
    assert list(seen.values()) == [1.0, 1.0, 0.7, 0.7]
    plain, _ = spy_run(ScoutPolicy(0.6, scale=1.0))
    assert torch.equal(halves.plan.recompute_depth, plain.plan.recompute_depth)
    assert (halves.result.logits - plain.result.logits).abs().max() > 1e-4
    assert (halves.result.logits - uniform.result.logits).abs().max() > 1e-4


def test_image_scale_field_of_the_name():
    """`:i<S>` (S of a prompt whose linked items are mostly images) after `:s`, before `:k` and
    `:d`, spelled only when not `IMAGE_SCALE`; every canonical name parses to itself."""
    assert get_policy("auto").image_scale == IMAGE_SCALE == 1.0
    named = get_policy("scout-0.2:s0.9/0.8:i0.95:k8:d0")
    assert (named.image_scale, named.sinks, named.offset_tau) == (0.95, 8, 0.0)
    assert named.name == "scout-0.2:s0.9/0.8:i0.95:k8:d0"
    assert get_policy(named.name).name == named.name
    assert get_policy("scout-0.2:s0.8:i1").name == "scout-0.2:s0.8"
    for bad in ("scout-0.2:k8:i0.9", "scout-0.2:i0.9:i0.8", "scout-0.2:i0", "scout-0.2:ix"):
        with pytest.raises(ValueError, match="valid:"):
            get_policy(bad)


def test_image_prompts_take_the_image_scale():
    """The toy's items are images: S = `image_scale` in every layer, whatever `:s` says; 1
    (the default) is no correction at all, the same logits as S = 1 everywhere."""
    adapter, plan, entries = _setup()
    assert mostly_images(plan, entries)
    plain, _ = _run(adapter, plan, entries, ScoutPolicy(0.6, scale=1.0))
    documents_s, kv = _run(adapter, plan, entries, ScoutPolicy(0.6, scale=0.7, late_scale=0.6))
    assert kv.correction is None
    torch.testing.assert_close(documents_s.result.logits, plain.result.logits, rtol=0, atol=0)
    images_s, kv = _run(adapter, plan, entries, ScoutPolicy(0.6, scale=0.7, image_scale=0.8))
    assert kv.correction is not None
    assert [kv.correction.scale_at(layer) for layer in range(L)] == [0.8] * L
    assert (images_s.result.logits - plain.result.logits).abs().max() > 1e-4


def test_mostly_images_counts_item_tokens_by_entry_kind():
    adapter, plan, entries = _setup()
    assert not mostly_images(plan, [])  # no entries: the documents' S
    as_text = [dataclasses.replace(e, media_type="text") for e in entries]
    assert not mostly_images(plan, as_text)
    # img-a (linked twice) as an image, img-b as text: img-a's tokens are the majority
    mixed = [entries[0], as_text[1]] if entries[0].entry_id == "img-a" else [as_text[0], entries[1]]
    assert mostly_images(plan, mixed)


def test_layers_and_question_weight_fields_reach_the_scout():
    """`:l<a>-<b>` and `:w<w>`: the link pass scores those layers with that weight (its report
    and its selection equal `select` over `scout_scores` called with them, and differ from the
    default fields'); a layer the model does not have is a ValueError when the prompt is
    planned, before any KV is touched."""
    adapter, plan, entries = _setup()
    out, _ = _run(adapter, plan, entries, "scout-0.5:l1-2:w0.5")
    assert out.scout.scoring_layers == (1, 2) and out.scout.layers_run == 3
    from mpic.linker.link import linked_items

    pre = ScoutPolicy(0.5).apply(plan, entries, L)
    items = linked_items(pre, entries, adapter.rope, L, every_item=True)
    kv = DenseLinkedKV(L, plan.num_tokens, 2, 8)
    items.write_to(kv)
    scores, _ = scout_scores(adapter, pre, entries, kv, [1, 2], items, 0.5)
    policy = get_policy("scout-0.5:l1-2:w0.5")
    want = policy.select(pre, entries, scores, L)
    assert torch.equal(out.plan.recompute_depth, want)
    default, _ = _run(adapter, plan, entries, "scout-0.5")
    assert default.scout.scoring_layers == tuple(scout_layers(L)) != (1, 2)
    with pytest.raises(ValueError, match="past the model's 4 layers"):
        with_policy(plan, entries, get_policy("scout-0.5:l2-4"), L)
