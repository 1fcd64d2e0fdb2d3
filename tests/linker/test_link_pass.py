"""The one link pass over a batch (`mpic.linker.pipeline.link_pass`) on the toy decoder: N
requests of mixed policies linked together equal each linked alone (`link_and_prefill`, the
batch of one): the same final depths and the same logits and linked KV to float tolerance; the
scouting requests share ONE scouting pass (one run of the scout's layers over their stacked
text), the two-step ones ONE text-first pass; in-pass hooks (CacheBlend) select each over its own
rows; the stacked KV routes rows to their requests."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from mpic.linker.kv.dense import DenseLinkedKV
from mpic.linker.kv.stacked import StackedLinkedKV
from mpic.linker.pipeline import _BatchHook, link_and_prefill, link_pass
from mpic.linker.plan import build_plan, resolve_entries, unique_entries
from mpic.linker.policies.cacheblend import KVDeviationHook
from mpic.linker.policies.scout import scout_layers
from mpic.linker.prefix import PrefixCache
from mpic.linker.recipe import with_policy
from mpic.linker.two_step import prefill_text_first
from tests.linker.toy_model import CONTEXT, IMAGE_ID, ToyAdapter, toy_entries, toy_spec

L = 6
PROMPTS = [
    (CONTEXT + [10, IMAGE_ID, 12, IMAGE_ID, 13, 14], ["img-a", "img-b"]),
    (
        CONTEXT + [10, 11, IMAGE_ID, 12, IMAGE_ID, 13, IMAGE_ID, 14, 15, 16],
        ["img-b", "img-a", "img-b"],
    ),
    (CONTEXT + [IMAGE_ID, 20, 21], ["img-a"]),
    ([9, 8, 10, IMAGE_ID, 11, 12, 13], ["img-b"]),
]


class _Counting:
    """The toy adapter, counting the calls of each layer's projections."""

    def __init__(self, adapter: ToyAdapter) -> None:
        self._a = adapter
        self.calls: list[int] = []

    def __getattr__(self, name):
        return getattr(self._a, name)

    def attention_inputs(self, layer, hidden, positions):
        self.calls.append(layer)
        return self._a.attention_inputs(layer, hidden, positions)


def _planned(adapter, policies, prefix=False):
    store = toy_entries(adapter)
    out = []
    for (prompt, refs), name in zip(PROMPTS * 4, policies, strict=False):
        items = resolve_entries(refs, store)
        plan = build_plan(toy_spec(adapter), prompt, items)
        planned = with_policy(plan, unique_entries(plan, items), name, adapter.num_layers)
        if prefix:
            planned = dataclasses.replace(
                planned, prefix=PrefixCache(adapter).lookup(planned.plan, planned.entries)
            )
        out.append(planned)
    return out


def _kv(adapter, planned):
    return DenseLinkedKV(adapter.num_layers, planned.plan.num_tokens, 2, 8)


def _batch_equals_alone(adapter, planned):
    """Link `planned` one at a time, then in one batch: the same final depths, logits and
    linked KV (float tolerance). Returns the batch's outcomes."""
    alone = []
    for p in planned:
        kv = _kv(adapter, p)
        alone.append((link_and_prefill(adapter, p, kv), kv))
    kvs = [_kv(adapter, p) for p in planned]
    together = link_pass(adapter, planned, kvs)
    for (ref, ref_kv), out, kv in zip(alone, together, kvs, strict=True):
        assert torch.equal(out.plan.recompute_depth, ref.plan.recompute_depth)
        assert torch.equal(out.result.recompute_depth, ref.result.recompute_depth)
        assert out.recomputed_tokens == ref.recomputed_tokens
        assert out.cached_prefix == ref.cached_prefix
        torch.testing.assert_close(out.result.logits, ref.result.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv.keys, ref_kv.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv.values, ref_kv.values, rtol=1e-5, atol=1e-5)
    return together


@pytest.mark.parametrize("mrope", [False, True])
@pytest.mark.parametrize("prefix", [False, True])
def test_a_batch_equals_each_request_alone(mrope, prefix):
    adapter = ToyAdapter(mrope=mrope, num_layers=L)
    policies = [
        "mpic-2",
        "auto",
        "full-reuse",
        "scout-0.6:s0.8",
        "vlcache-0.5:0.34:0",
        "full",
        "auto-0.3",
        "full-reuse",
    ]
    together = _batch_equals_alone(adapter, _planned(adapter, policies, prefix))
    scouted = [out.scout for out in together if out.scout is not None]
    assert len(scouted) == 3 and all(s.requests == 3 for s in scouted)


def test_eight_scouting_requests_share_one_scout_pass():
    adapter = _Counting(ToyAdapter(num_layers=L))
    planned = _planned(adapter._a, ["auto"] * 8)
    run_to = scout_layers(L)[-1] + 1
    together = link_pass(adapter, planned, [_kv(adapter, p) for p in planned])
    # the scout's layers once over the 8 requests' text, then the selective pass once
    assert adapter.calls == list(range(run_to)) + list(range(L))
    assert [out.scout.requests for out in together] == [8] * 8
    assert all(out.scout.layers_run == run_to for out in together)
    adapter.calls.clear()
    for p in planned:  # one at a time: a scout and a pass per request
        assert link_and_prefill(adapter, p, _kv(adapter, p)).scout.requests == 1
    assert len(adapter.calls) == 8 * (run_to + L)


def test_two_step_requests_share_one_text_first_pass():
    # full reuse's text-first pass (its text alone in view) for 4 requests: ONE run of the
    # layers over their stacked text, then the selective pass once (each last token)
    adapter = _Counting(ToyAdapter(num_layers=L))
    planned = _planned(adapter._a, ["full-reuse"] * 4)
    together = link_pass(adapter, planned, [_kv(adapter, p) for p in planned])
    assert adapter.calls == list(range(L)) + list(range(L))
    texts = [int(p.plan.is_text.sum()) for p in planned]
    assert [out.recomputed_tokens for out in together] == texts  # the last token is text
    adapter.calls.clear()
    for p in planned:
        link_and_prefill(adapter, p, _kv(adapter, p))
    assert len(adapter.calls) == 4 * 2 * L


class _Writes:
    """A linked KV, recording its writes: per layer (`write`) and of all layers at once."""

    def __init__(self, kv) -> None:
        self._kv = kv
        self.per_layer = 0
        self.all_layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __getattr__(self, name):
        return getattr(self._kv, name)

    def write(self, layer, index, k, v):
        self.per_layer += 1
        self._kv.write(layer, index, k, v)

    def write_layers(self, index, k, v):
        self.all_layers.append((index, k))
        self._kv.write_layers(index, k, v)


def test_text_first_kv_goes_in_with_one_write_of_all_layers():
    # on CUDA a write copies its host index to the device, a blocking copy (a host sync): the
    # text-first KV goes into each prompt's linked KV in one write of all its layers
    adapter = ToyAdapter(num_layers=L)
    planned = _planned(adapter, ["full-reuse"] * 3)
    kvs = [_Writes(_kv(adapter, p)) for p in planned]
    prefill_text_first(adapter, [(p.plan, kv) for p, kv in zip(planned, kvs, strict=True)])
    for p, kv in zip(planned, kvs, strict=True):
        text = torch.nonzero(p.plan.is_text).flatten()
        assert kv.per_layer == 0 and len(kv.all_layers) == 1
        index, keys = kv.all_layers[0]
        assert torch.equal(index, text) and keys.shape[:2] == (L, text.numel())
        assert bool(kv.keys[:, text].abs().sum(dim=(1, 2, 3)).gt(0).all())  # every layer written


def test_in_pass_hooks_each_select_their_own_rows_in_a_batch():
    # CacheBlend's KV-deviation check (an in-pass hook) in a batch: each request's hook sees its
    # own rows, indices and linked KV, so each keeps what it keeps alone (depths equal)
    adapter = ToyAdapter(num_layers=L)
    policies = ["cacheblend-15", "mpic-2", "cacheblend-50", "auto", "cacheblend-15"]
    together = _batch_equals_alone(adapter, _planned(adapter, policies))
    # the check kept some item tokens and dropped others (it acted), differently per request
    stopped = [out.result.recompute_depth for out in together]
    dropped = [int(((d > 0) & (d < L)).sum()) for d in stopped]  # stopped at the check layer
    assert dropped[0] > 0 and dropped[2] > 0 and dropped[1] == 0


def test_a_batch_hook_reads_nothing_where_no_hook_acts():
    # on CUDA reading the active index is a host sync: a batch reads it only at a layer where
    # one of its hooks acts (CacheBlend's check layer), as a hook alone does
    hook = KVDeviationHook(check_layer=1, count=1, last_index=3)
    cacheblend = SimpleNamespace(hook=hook, offset=0, plan=SimpleNamespace(num_tokens=4), kv=None)
    batch = _BatchHook([cacheblend, SimpleNamespace(hook=None, kv=None)])
    assert [batch.acts_at(layer) for layer in range(3)] == [False, True, False]
    assert batch.select(0, None, None, None) is None  # None: the index is not even touched
    assert batch.select(2, None, None, None) is None


def test_stacked_kv_routes_rows_to_their_requests():
    kvs = [DenseLinkedKV(1, n, 1, 2) for n in (3, 4)]
    stacked = StackedLinkedKV(kvs, [3, 4])
    assert stacked.offsets.tolist() == [0, 3, 7] and stacked.total == 7
    index = torch.tensor([0, 2, 3, 6])
    k = torch.arange(8.0).view(4, 1, 2)
    stacked.write(0, index, k, -k)
    assert torch.equal(kvs[0].keys[0, [0, 2]], k[:2]) and torch.equal(kvs[1].keys[0, [0, 3]], k[2:])
    assert torch.equal(kvs[1].values[0, 3], -k[3])
    assert torch.equal(stacked.read_keys(0, index), k)
    assert stacked._requests(index) == [(0, 2, 0), (2, 4, 1)]
    with pytest.raises(ValueError):
        StackedLinkedKV(kvs, [3])
