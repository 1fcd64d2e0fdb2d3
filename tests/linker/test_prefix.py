"""The template/system prefix linked exactly (`mpic.linker.prefix`) on the toy decoder: which
tokens qualify, the same logits as recomputing them, counted as cached, and a scouting policy
spending their share of the budget on item tokens."""

import dataclasses

import pytest
import torch

from mpic.linker.kv.dense import DenseLinkedKV
from mpic.linker.pipeline import link_and_prefill
from mpic.linker.plan import build_plan, resolve_entries, unique_entries
from mpic.linker.policies import get_policy
from mpic.linker.policies.base import Policy
from mpic.linker.policies.scout import ScoutPolicy
from mpic.linker.prefix import PrefixCache, common_prefix, prefix_length, takes_prefix
from mpic.linker.recipe import with_policy
from tests.linker.toy_model import CONTEXT, IMAGE_ID, ToyAdapter, toy_entries, toy_spec

L = 4
PROMPT = CONTEXT + [10, 11, IMAGE_ID, 12, IMAGE_ID, 13, IMAGE_ID, 14, 15, 16]
REFS = ["img-a", "img-b", "img-a"]


def _setup(mrope=False, prompt=PROMPT):
    adapter = ToyAdapter(mrope=mrope, num_layers=L)
    items = resolve_entries(REFS, toy_entries(adapter))
    plan = build_plan(toy_spec(adapter), prompt, items)
    return adapter, plan, unique_entries(plan, items)


class _Fixed(Policy):
    def __init__(self, depth):
        self.depth, self.name = depth, "fixed"

    def depths(self, plan, entries, num_layers):
        return self.depth


def _run(adapter, plan, entries, policy, prefix=None):
    planned = dataclasses.replace(with_policy(plan, entries, policy, L), prefix=prefix)
    kv = DenseLinkedKV(L, plan.num_tokens, 2, 8)
    return link_and_prefill(adapter, planned, kv), kv


def test_which_tokens_qualify():
    adapter, plan, entries = _setup()
    assert common_prefix(plan, CONTEXT) == len(CONTEXT)
    assert common_prefix(plan, CONTEXT + [10, 11, 99]) == len(CONTEXT) + 2  # stops at a mismatch
    assert common_prefix(plan, PROMPT) == PROMPT.index(IMAGE_ID)  # never past the first item
    assert common_prefix(plan, [9] + CONTEXT) == 0
    cache = PrefixCache(adapter, toy_spec(adapter).family)
    found = cache.lookup(plan, entries)
    assert found is not None and found.length == len(CONTEXT)
    _, other, other_entries = _setup(prompt=[9] + PROMPT[1:])
    assert cache.lookup(other, other_entries) is None


@pytest.mark.parametrize("mrope", [False, True])
def test_the_linked_prefix_gives_the_recomputed_prefix_logits_and_counts_as_cached(mrope):
    adapter, plan, entries = _setup(mrope)
    prefix = PrefixCache(adapter, toy_spec(adapter).family).lookup(plan, entries)
    assert prefix is not None
    depth = torch.where(plan.is_text | (torch.arange(plan.num_tokens) % 3 == 0), L, 0)
    plain, kv_plain = _run(adapter, plan, entries, _Fixed(depth))
    linked, kv = _run(adapter, plan, entries, _Fixed(depth), prefix)
    p = prefix.length
    assert linked.recomputed_tokens == plain.recomputed_tokens - p
    assert bool((linked.plan.recompute_depth[:p] == 0).all())
    # the context pass and the selective pass reach the same keys by different kernel calls:
    # float32 rounding (1.7e-6 seen on an AMD EPYC host), far below a wrong prefix's O(1)
    torch.testing.assert_close(kv.keys[:, :p], kv_plain.keys[:, :p], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linked.result.logits, plain.result.logits, rtol=1e-5, atol=1e-5)


def test_a_scout_spends_the_prefix_share_on_item_tokens():
    adapter, plan, entries = _setup()
    prefix = PrefixCache(adapter, toy_spec(adapter).family).lookup(plan, entries)
    policy = ScoutPolicy(0.8, scale=0.8)
    plain, _ = _run(adapter, plan, entries, policy)
    linked, _ = _run(adapter, plan, entries, policy, prefix)
    items = ~plan.is_text
    chosen_plain = int((plain.plan.recompute_depth[items] > 0).sum())
    chosen_linked = int((linked.plan.recompute_depth[items] > 0).sum())
    assert chosen_linked == min(chosen_plain + prefix.length, int(items.sum()))
    assert linked.recomputed_tokens == plain.recomputed_tokens - prefix.length + (
        chosen_linked - chosen_plain
    )


def test_two_step_policies_recompute_the_prefix():
    adapter, plan, entries = _setup()
    prefix = PrefixCache(adapter, toy_spec(adapter).family).lookup(plan, entries)
    plain, _ = _run(adapter, plan, entries, "full-reuse")
    linked, _ = _run(adapter, plan, entries, "full-reuse", prefix)
    assert linked.recomputed_tokens == plain.recomputed_tokens
    torch.testing.assert_close(linked.result.logits, plain.result.logits)


@pytest.mark.parametrize("mrope", [False, True])
def test_the_family_is_read_from_the_adapter_when_not_given(mrope):
    """The vLLM worker builds its cache from the layer adapter alone (M-RoPE from its RoPE)."""
    adapter, plan, entries = _setup(mrope)
    given = PrefixCache(adapter, toy_spec(adapter).family).lookup(plan, entries)
    read = PrefixCache(adapter).lookup(plan, entries)
    assert prefix_length(plan, entries) == given.length == read.length == len(CONTEXT)
    torch.testing.assert_close(read.keys, given.keys, rtol=0, atol=0)


def test_contexts_are_prefilled_once_and_the_cache_is_bounded():
    adapter, plan, entries = _setup()
    cache = PrefixCache(adapter, max_contexts=1)
    cache.lookup(plan, entries)
    cache.lookup(plan, entries)
    assert cache.prefills == 1
    _, other, other_entries = _setup(prompt=[9] + PROMPT[1:])
    other_entries = [
        dataclasses.replace(e, extra={**e.extra, "context_token_ids": [9] + CONTEXT[1:]})
        for e in other_entries
    ]
    assert cache.lookup(other, other_entries).length == len(CONTEXT)
    assert cache.prefills == 2 and len(cache._kv) == 1  # the first context was evicted
    cache.lookup(plan, entries)
    assert cache.prefills == 3


def test_which_policies_take_the_prefix():
    adapter, plan, entries = _setup()
    assert takes_prefix(get_policy("mpic-2"), plan, L)
    assert takes_prefix(get_policy("scout-0.3"), plan, L)
    for name in ("full", "prefix", "full-reuse", "cacheblend-15"):
        assert not takes_prefix(get_policy(name), plan, L), name
