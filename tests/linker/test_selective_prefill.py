"""docs/design.md oracles on a toy pure-torch decoder (1-D RoPE and M-RoPE): the selective path with
every token recomputed equals a plain prefill; an item linked where it was cached, after the same
context, gives the exact result with no item recompute; VLCache depths keep cached KV below."""

import pytest
import torch

from mpic.kernels.rope import rotate_keys
from mpic.linker.kv.dense import DenseLinkedKV
from mpic.linker.link import link_entries
from mpic.linker.pipeline import link_and_prefill
from mpic.linker.plan import build_plan, resolve_entries, unique_entries
from mpic.linker.recipe import with_policy
from tests.linker.toy_model import (
    CONTEXT,
    IMAGE_ID,
    ToyAdapter,
    reference_forward,
    toy_entries,
    toy_spec,
)

PROMPT = CONTEXT + [10, 11, IMAGE_ID, 12, IMAGE_ID, 13, IMAGE_ID, 14, 15]
REFS = ["img-a", "img-b", "img-a"]


def _setup(mrope: bool, prompt=PROMPT, refs=REFS):
    adapter = ToyAdapter(mrope=mrope)
    store = toy_entries(adapter)
    items = resolve_entries(refs, store)
    plan = build_plan(toy_spec(adapter), prompt, items)
    entries = unique_entries(plan, items)
    return adapter, plan, entries


def _plain_embeds(adapter, plan, entries):
    rows = []
    for i in range(plan.num_tokens):
        e = int(plan.source_entry[i])
        if e < 0:
            rows.append(adapter.embed_tokens(plan.token_ids[i : i + 1]))
        else:
            rows.append(entries[e].input_embeds[plan.source_offset[i] : plan.source_offset[i] + 1])
    return torch.cat(rows)


def _run(adapter, plan, entries, name):
    kv = DenseLinkedKV(adapter.num_layers, plan.num_tokens, 2, 8)
    planned = with_policy(plan, entries, name, adapter.num_layers)
    return link_and_prefill(adapter, planned, kv), kv


@pytest.mark.parametrize("mrope", [False, True])
def test_full_recompute_equals_plain_prefill(mrope):
    adapter, plan, entries = _setup(mrope)
    ref_logits, ref_k, ref_v = reference_forward(
        adapter, _plain_embeds(adapter, plan, entries), plan.positions
    )
    out, kv = _run(adapter, plan, entries, "full")
    assert out.recomputed_tokens == plan.num_tokens
    torch.testing.assert_close(out.result.logits, ref_logits[-1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv.keys, ref_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv.values, ref_v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mrope", [False, True])
def test_same_place_same_context_is_exact_without_item_recompute(mrope):
    prompt = CONTEXT + [IMAGE_ID, 20, 21, 22]
    adapter, plan, entries = _setup(mrope, prompt, ["img-a"])
    ref_logits, _, _ = reference_forward(
        adapter, _plain_embeds(adapter, plan, entries), plan.positions
    )
    out, kv = _run(adapter, plan, entries, "mpic-0")
    assert (out.result.recompute_depth[plan.source_entry >= 0] == 0).all()
    assert out.recomputed_tokens == len(prompt) - 1
    torch.testing.assert_close(kv.keys[:, 3:9], entries[0].keys, rtol=0, atol=0)
    torch.testing.assert_close(out.result.logits, ref_logits[-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mrope", [False, True])
def test_moved_item_differs_and_more_recompute_gets_closer(mrope):
    adapter, plan, entries = _setup(mrope)
    ref_logits, _, _ = reference_forward(
        adapter, _plain_embeds(adapter, plan, entries), plan.positions
    )
    errors = [
        (_run(adapter, plan, entries, f"mpic-{k}")[0].result.logits - ref_logits[-1]).abs().max()
        for k in (0, 6)
    ]
    assert errors[0] > 1e-4  # reuse after another context is approximate...
    assert errors[1] < 1e-5  # ...and recomputing every item token is exact again


def test_vlcache_tokens_keep_cached_kv_from_their_depth_on():
    adapter, plan, entries = _setup(mrope=False)
    out, kv = _run(adapter, plan, entries, "vlcache-0.5:0.34:0")
    depth = out.result.recompute_depth
    # img-a (T=6) first occurrence at slots 5..10: offsets 0-2 depth 2, offset... (floor(r*T))
    assert depth[5:11].tolist() == [2, 2, 1, 0, 0, 0]
    assert depth[12:16].tolist() == [2, 1, 0, 0]  # img-b, T=4: floor(2), floor(1.36)=1
    fresh = _run(adapter, plan, entries, "full")[1]
    slot, e = 6, entries[0]  # offset 1 of img-a, depth 2: fresh at layers 0-1, cached at 2
    assert not torch.equal(kv.keys[2, slot], fresh.keys[2, slot])
    torch.testing.assert_close(kv.values[2, slot], e.values[2, 1], rtol=0, atol=0)
    assert not torch.equal(kv.values[1, slot], e.values[1, 1])


def test_cacheblend_dropped_tokens_keep_cached_kv_and_deviation_sees_it():
    adapter, plan, entries = _setup(mrope=False)
    out, kv = _run(adapter, plan, entries, "cacheblend-15")
    depth = out.result.recompute_depth
    items = torch.nonzero(plan.source_entry >= 0).flatten()
    dropped = items[depth[items] == 1]  # check layer 1: recomputed at layer 0 only
    assert dropped.numel() > 0
    for slot in dropped.tolist():
        e = entries[int(plan.source_entry[slot])]
        off = int(plan.source_offset[slot])
        torch.testing.assert_close(kv.values[1:, slot], e.values[1:, off], rtol=0, atol=0)
    # all text, the last token, and ceil(15% of the item tokens) among the others
    kept = (depth == adapter.num_layers) & (plan.source_entry >= 0)
    kept[-1] = False
    assert bool((depth[plan.is_text] == adapter.num_layers).all())
    assert int(kept.sum()) == -(-15 * items.numel() // 100)


POLICIES = ["full", "mpic-0", "mpic-2", "vlcache-0.5:0.34:0", "cacheblend-15", "full-reuse"]


@pytest.mark.parametrize("mrope", [False, True])
@pytest.mark.parametrize("name", POLICIES)
def test_flex_backend_equals_sdpa_runs_oracle_in_the_pass(mrope, name):
    """The one-call FlexAttention path links exactly what the per-run SDPA oracle links."""
    adapter, plan, entries = _setup(mrope)
    outs = {}
    for backend in ("sdpa_runs", "flex"):
        kv = DenseLinkedKV(adapter.num_layers, plan.num_tokens, 2, 8, backend=backend)
        planned = with_policy(plan, entries, name, adapter.num_layers)
        outs[backend] = (link_and_prefill(adapter, planned, kv), kv)
    (ref, ref_kv), (out, kv) = outs["sdpa_runs"], outs["flex"]
    assert torch.equal(out.result.recompute_depth, ref.result.recompute_depth)
    torch.testing.assert_close(out.result.logits, ref.result.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv.keys, ref_kv.keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv.values, ref_kv.values, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mrope", [False, True])
def test_bulk_link_equals_entry_by_entry_layer_by_layer(mrope):
    """`link_entries` (one rotation, one write for all entries and layers) = the plain loop."""
    adapter, plan, entries = _setup(mrope)
    plan.recompute_depth = torch.zeros(plan.num_tokens, dtype=torch.int64)
    plan.recompute_depth[plan.is_text] = adapter.num_layers
    plan.recompute_depth[6] = 1  # a VLCache-like depth: linked too
    plan.recompute_depth[13] = adapter.num_layers  # recomputed: not linked
    bulk = DenseLinkedKV(adapter.num_layers, plan.num_tokens, 2, 8)
    linked = link_entries(bulk, plan, entries, adapter.rope, adapter.num_layers)
    loop = DenseLinkedKV(adapter.num_layers, plan.num_tokens, 2, 8)
    count = 0
    for slot in range(plan.num_tokens):
        e = int(plan.source_entry[slot])
        if e < 0 or int(plan.recompute_depth[slot]) >= adapter.num_layers:
            continue
        off = int(plan.source_offset[slot])
        old, new = entries[e].positions[..., off : off + 1], plan.positions[..., slot : slot + 1]
        for layer in range(adapter.num_layers):
            key = rotate_keys(entries[e].keys[layer, off : off + 1], old, new, adapter.rope)
            loop.write(layer, torch.tensor([slot]), key, entries[e].values[layer, off : off + 1])
        count += 1
    assert linked == count == int((~plan.is_text).sum()) - 1
    torch.testing.assert_close(bulk.keys, loop.keys, rtol=1e-6, atol=1e-6)
    assert torch.equal(bulk.values, loop.values)


@pytest.mark.parametrize("backend", ["sdpa_runs", "flex"])
@pytest.mark.parametrize("name", [*POLICIES, "scout-0.5:s0.9/0.8"])
def test_heads_major_linked_kv_equals_token_major(backend, name):
    """`DenseLinkedKV(heads_major=True)` (K/V stored [L, H_kv, N, D], each layer's keys read by
    the kernels without a copy) runs the same pass to the same numbers, the correction of a
    scouting policy included."""
    adapter, plan, entries = _setup(True)
    outs = {}
    for heads_major in (False, True):
        kv = DenseLinkedKV(
            adapter.num_layers, plan.num_tokens + 2, 2, 8, backend=backend, heads_major=heads_major
        )
        planned = with_policy(plan, entries, name, adapter.num_layers)
        outs[heads_major] = (link_and_prefill(adapter, planned, kv), kv)
    (ref, ref_kv), (out, kv) = outs[False], outs[True]
    assert kv.keys.shape == ref_kv.keys.shape
    assert kv.keys[1].transpose(0, 1).is_contiguous()  # [H_kv, N, D]: the kernels' layout
    assert torch.equal(out.result.recompute_depth, ref.result.recompute_depth)
    torch.testing.assert_close(out.result.logits, ref.result.logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kv.keys, ref_kv.keys, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kv.values, ref_kv.values, rtol=1e-6, atol=1e-6)
    index = torch.tensor([0, 3, plan.num_tokens - 1])
    assert torch.equal(kv.read_keys(1, index), ref_kv.read_keys(1, index))


@pytest.mark.parametrize("pick", ["all", "sparse", "none"])
def test_gathered_input_embeds_equal_row_by_row(pick):
    """The runs-and-one-cat gather gives every row's own embedding (text, entry rows at any
    offsets, an entry linked twice, an empty index)."""
    from mpic.linker.link import gather_input_embeds

    adapter, plan, entries = _setup(False)
    index = {
        "all": torch.arange(plan.num_tokens),
        "sparse": torch.tensor([0, 2, 3, 4, 6, 7, 9, 12, 13, 15, plan.num_tokens - 1]),
        "none": torch.zeros(0, dtype=torch.int64),
    }[pick]
    got = gather_input_embeds(adapter, plan, entries, index)
    want = _plain_embeds(adapter, plan, entries)[index]
    assert got.shape == want.shape
    assert torch.equal(got, want)


class _CountingAdapter(ToyAdapter):
    """The toy decoder, counting the rows that reach attention output + MLP per layer."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.mlp_rows: list[tuple[int, int]] = []

    def attention_output_and_mlp(self, layer, hidden, attn):
        self.mlp_rows.append((layer, int(hidden.shape[0])))
        return super().attention_output_and_mlp(layer, hidden, attn)


@pytest.mark.parametrize("mrope", [False, True])
def test_a_tokens_last_layer_runs_mlp_only_for_rows_read_on(mrope):
    """run_layers' outputs: the KV and the rows read are exactly as without it, while the last
    layer a token runs skips its MLP unless a later layer or the caller reads it (VLCache
    depths end early; the caller reads one row, or none)."""
    from mpic.linker.selective_prefill import run_layers

    adapter = _CountingAdapter(mrope=mrope, num_layers=4)
    _, plan, entries = _setup(mrope)
    n, L = plan.num_tokens, adapter.num_layers
    embeds = _plain_embeds(adapter, plan, entries)
    depth = torch.full((n,), L, dtype=torch.int64)
    depth[5:11] = torch.tensor([3, 3, 2, 1, 1, 2])  # tokens that stop early (VLCache)

    def run(outputs):
        adapter.mlp_rows.clear()
        kv = DenseLinkedKV(L, n, 2, 8)
        args = (embeds, torch.arange(n), plan.positions, depth)
        hidden, index, ran = run_layers(adapter, kv, *args, outputs=outputs)
        return hidden, index, ran, kv, list(adapter.mlp_rows)

    h_all, i_all, d_all, kv_all, rows_all = run(None)
    last = torch.zeros(n, dtype=torch.bool)
    last[-1] = True
    h_last, i_last, d_last, kv_last, rows_last = run(last)
    h_none, i_none, _, kv_none, rows_none = run(torch.zeros(n, dtype=torch.bool))

    assert i_all.tolist() == [i for i in range(n) if depth[i] == L]
    assert i_last.tolist() == [n - 1] and i_none.numel() == 0 and h_none.shape[0] == 0
    torch.testing.assert_close(h_last, h_all[-1:], rtol=1e-5, atol=1e-5)
    assert torch.equal(d_all, depth) and torch.equal(d_last, depth)
    for kv in (kv_last, kv_none):  # every token's KV, at every layer it runs, unchanged
        torch.testing.assert_close(kv.keys, kv_all.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv.values, kv_all.values, rtol=1e-5, atol=1e-5)
    # a layer's MLP rows: the tokens running a later layer (+ the rows read, at the last)
    later = [int((depth > layer + 1).sum()) for layer in range(L - 1)]
    assert rows_all == [*enumerate(later), (L - 1, int((depth == L).sum()))]
    assert rows_last == [*enumerate(later), (L - 1, 1)]
    assert rows_none == list(enumerate(later))  # the last layer: K/V written, nothing else
