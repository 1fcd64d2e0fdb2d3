"""A parsed policy as a value that travels: every policy family pickles (the Resolver replica's
parse reaches the LLM worker through Ray; the vLLM connector's job reaches its worker half in
vLLM's pickled step metadata) and comes back equal by name, fields and behaviour (the same
prefill on the toy model); `with_scales` gives what parsing the name against a model's scout
table gives, without parsing it again."""

from __future__ import annotations

import pickle

import pytest
import torch

from mpic.linker.kv.dense import DenseLinkedKV
from mpic.linker.pipeline import link_and_prefill
from mpic.linker.plan import build_plan, resolve_entries, unique_entries
from mpic.linker.policies import get_policy
from mpic.linker.recipe import with_policy
from tests.linker.toy_model import CONTEXT, IMAGE_ID, ToyAdapter, toy_entries, toy_spec

NAMES = [
    "full",
    "prefix",
    "full-reuse",
    "cacheblend-15",
    "mpic-2",
    "boundary-1",
    "vlcache-0.5",
    "vlcache-0.5:0.3",
    "scout-0.3",
    "scout-0.3:s0.9/0.8:k2:d0",
    "auto",
    "auto-0.4",
]
"""One name or more of every family `get_policy` parses."""

TABLES = [((0.1, 0.7), (0.3, 0.6)), ((0.1, 0.9, 0.7), (0.5, 0.8, 0.6))]
"""A model's own scout tables: (budget, S) rows and (budget, S first half, S second half)."""


def _prefill(policy):
    """The toy model's linked prefill of two items under `policy`: logits and the final depths."""
    torch.manual_seed(0)
    adapter = ToyAdapter(mrope=False)
    items = resolve_entries(["img-a", "img-b", "img-a"], toy_entries(adapter))
    prompt = CONTEXT + [10, 11, IMAGE_ID, 12, IMAGE_ID, 13, IMAGE_ID, 14, 15]
    plan = build_plan(toy_spec(adapter), prompt, items)
    entries = unique_entries(plan, items)
    kv = DenseLinkedKV(adapter.num_layers, plan.num_tokens, 2, 8)
    out = link_and_prefill(adapter, with_policy(plan, entries, policy, adapter.num_layers), kv)
    return out.result.logits, out.plan.recompute_depth


@pytest.mark.parametrize("name", NAMES)
def test_every_policy_pickles_to_an_equal_policy(name: str) -> None:
    policy = get_policy(name)
    back = pickle.loads(pickle.dumps(policy))
    assert type(back) is type(policy) and back.name == policy.name
    assert vars(back) == vars(policy)
    logits, depths = _prefill(policy)
    again, again_depths = _prefill(back)
    assert torch.equal(depths, again_depths)
    torch.testing.assert_close(logits, again, rtol=0, atol=0)


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("name", NAMES)
def test_with_scales_equals_parsing_against_the_table(name: str, table) -> None:
    parsed = get_policy(name, scales=table)
    scaled = get_policy(name).with_scales(table)
    assert type(scaled) is type(parsed) and scaled.name == parsed.name
    assert vars(scaled) == vars(parsed)
    assert get_policy(name).with_scales(None).name == get_policy(name).name
    spelled = get_policy(parsed.name)  # a canonical name carries its S: the table is moot
    assert spelled.with_scales(table).name == parsed.name
