"""Contract over the policy registry: each policy selects exactly the tokens its paper defines."""

import math

import pytest
import torch

from mpic.linker.kv.dense import DenseLinkedKV
from mpic.linker.plan import build_plan, resolve_entries, unique_entries
from mpic.linker.policies import get_policy, policy_names
from mpic.linker.policies.cacheblend import CacheBlendPolicy
from tests.linker.toy_model import CONTEXT, IMAGE_ID, ToyAdapter, toy_entries, toy_spec

L = 3
# slots: text 0-4 | img-a 5-10 | text 11 | img-b 12-15 | text 16 | img-a 17-22 | text 23-24
PROMPT = CONTEXT + [10, 11, IMAGE_ID, 12, IMAGE_ID, 13, IMAGE_ID, 14, 15]
# a prompt that starts exactly like img-a's canonical context: prefix caching hits img-a
PREFIX_PROMPT = CONTEXT + [IMAGE_ID, 12, IMAGE_ID, 13]


def _plan(prompt, refs):
    adapter = ToyAdapter(num_layers=L)
    items = resolve_entries(refs, toy_entries(adapter))
    plan = build_plan(toy_spec(adapter), prompt, items)
    return plan, unique_entries(plan, items)


def expected(name: str, plan, prefix_hit: bool) -> list[int]:
    """Depths written out from each paper's definition, independent of the policy code."""
    text, off = plan.is_text.tolist(), plan.source_offset.tolist()
    src, n = plan.source_entry.tolist(), plan.num_tokens
    sizes = {0: 6, 1: 4}
    if name == "full":
        out = [L] * n
    elif name == "full-reuse":
        out = [0] * n
    elif name.startswith("cacheblend"):
        out = [L] * n  # all run to the check layer; the hook selects (tested below)
    elif name.startswith("mpic-"):
        k = int(name.split("-")[1])
        out = [L if t or o < k else 0 for t, o in zip(text, off, strict=True)]
    elif name.startswith("vlcache-"):
        ratios = [float(r) for r in name.split("-")[1].split(":")]
        ratios += [ratios[-1]] * (L - len(ratios))
        out = [
            L if t else sum(o < math.floor(r * sizes[s] + 1e-9) for r in ratios)
            for t, o, s in zip(text, off, src, strict=True)
        ]
    elif name == "prefix":
        if prefix_hit:  # PREFIX_PROMPT: context + img-a match, the rest differs
            out = [L] * 3 + [0] * 6 + [L] * (n - 9)
        else:
            out = [L] * n
    out[-1] = L
    return out


NAMES = [
    "full",
    "prefix",
    "full-reuse",
    "cacheblend-15",
    "mpic-0",
    "mpic-2",
    "vlcache-0.1",
    "vlcache-0.5",
    "vlcache-0.5:0.34:0",
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", ["mixed", "prefix-hit"])
def test_policy_selects_exactly_its_tokens(name, case):
    prompt, refs = (
        (PROMPT, ["img-a", "img-b", "img-a"])
        if case == "mixed"
        else (PREFIX_PROMPT, ["img-a", "img-b"])
    )
    plan, entries = _plan(prompt, refs)
    policy = get_policy(name)
    assert policy.name == name
    assert policy.apply(plan, entries, L).recompute_depth.tolist() == expected(
        name, plan, case == "prefix-hit"
    )
    assert policy.two_step == (name in ("full-reuse",) or name.startswith("cacheblend"))


def test_cacheblend_hook_keeps_all_text_and_top_deviation_item_tokens():
    """As published: the new text is always recomputed; r% is taken over the item tokens only."""
    n, hkv, d = 40, 2, 4
    kv = DenseLinkedKV(3, n, hkv, d)
    fresh = torch.zeros(n, hkv, d)
    deviation = torch.randperm(n).float()
    fresh[:, 0, 0] = deviation.sqrt()
    is_text = torch.zeros(n, dtype=torch.bool)
    is_text[:12] = True  # 12 text tokens, 28 item tokens
    policy = CacheBlendPolicy(15)
    hook = policy.layer_hook(plan=_FakePlan(n, is_text), num_layers=3)
    index = torch.arange(n)
    assert hook.select(0, index, fresh, kv) is None
    keep = hook.select(1, index, fresh, kv)
    items = torch.arange(12, n - 1)  # the last token is kept anyway
    top = items[torch.topk(deviation[items], math.ceil(0.15 * 28)).indices].tolist()
    assert set(torch.nonzero(keep).flatten().tolist()) == set(range(12)) | set(top) | {n - 1}


class _FakePlan:
    def __init__(self, n, is_text):
        self.num_tokens, self.is_text = n, is_text


@pytest.mark.parametrize(
    "bad", ["nope", "mpic-x", "mpic--1", "vlcache-0.1:0.2", "vlcache-2", "cacheblend-150"]
)
def test_registry_rejects_bad_names_listing_valid_ones(bad):
    with pytest.raises(ValueError, match="valid: full, prefix"):
        get_policy(bad)


def test_policy_names_parses_a_cli_list():
    names = policy_names(" full, mpic-32,,vlcache-0.3:0.1 ")
    assert names == ["full", "mpic-32", "vlcache-0.3:0.1"]
    with pytest.raises(ValueError, match="valid: full, prefix"):
        policy_names("full,nope")
