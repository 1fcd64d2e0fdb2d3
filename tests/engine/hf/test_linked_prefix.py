"""The template/system prefix linked exactly on the trained SmolLM2 (`mpic.linker.prefix`, the
reference runner's default): its KV is the prompt's own exact prefill of those tokens, a prompt
that recomputes everything else gives the exact prefill's logits, and it is counted as cached
(not recomputed: a first-k policy gets P tokens cheaper, a scout spends them on item tokens)."""

from __future__ import annotations

import pytest
import torch

from mpic.linker.policies.base import Policy

pytestmark = pytest.mark.slow


class _AllButPrefix(Policy):
    """Every token recomputed at every layer (what is linked then is only the cached prefix)."""

    name = "all-but-prefix"

    def depths(self, plan, entries, num_layers):
        return torch.full((plan.num_tokens,), num_layers, dtype=torch.int64)


@torch.inference_mode()
def test_the_linked_prefix_is_the_exact_prefill(smollm2_question) -> None:
    runner, parts = smollm2_question
    assert runner.prefixes is not None  # on by default
    planned = runner.plan(parts, "mpic-32")
    prefix = planned.prefix
    assert prefix is not None and prefix.length == 24  # SmolLM2's system turn + user header
    context = planned.entries[0].extra["context_token_ids"]
    assert planned.plan.token_ids[: prefix.length].tolist() == context[: prefix.length]
    exact = runner.prefill(parts, "full")
    assert exact.cached_prefix == 0  # `full` recomputes everything
    p = prefix.length
    # the same float32 math over other matmul shapes (24 tokens alone vs the whole prompt):
    # within 2e-5 of each other where the BLAS splits the work another way (a busy host's
    # thread count), values up to ~10
    torch.testing.assert_close(prefix.keys, exact.kv.keys[:, :p], atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(prefix.values, exact.kv.values[:, :p], atol=5e-5, rtol=1e-5)
    linked = runner.prefill(parts, _AllButPrefix())
    assert linked.cached_prefix == p
    assert linked.recomputed_tokens == exact.plan.num_tokens - p
    assert bool((linked.plan.recompute_depth[:p] == 0).all())
    assert (linked.logits - exact.logits).abs().max() < 1e-4


@torch.inference_mode()
def test_the_prefix_is_counted_as_cached_and_its_budget_share_goes_to_items(
    smollm2_question,
) -> None:
    runner, parts = smollm2_question
    on = runner.prefill(parts, "mpic-32")
    prefixes, runner.prefixes = runner.prefixes, None
    try:
        off = runner.prefill(parts, "mpic-32")
        scout_off = runner.prefill(parts, "scout-0.4")  # 0.2: the text alone fills it here
    finally:
        runner.prefixes = prefixes
    scout_on = runner.prefill(parts, "scout-0.4")
    p = on.cached_prefix
    assert p == 24 and off.cached_prefix == 0
    assert on.recomputed_tokens == off.recomputed_tokens - p  # first-k: p tokens cheaper
    assert scout_on.recomputed_tokens == scout_off.recomputed_tokens  # same budget ...
    items = on.plan.source_entry >= 0
    chosen_on = int((scout_on.plan.recompute_depth[items] > 0).sum())
    chosen_off = int((scout_off.plan.recompute_depth[items] > 0).sum())
    assert chosen_on == chosen_off + p  # ... spent on item tokens
