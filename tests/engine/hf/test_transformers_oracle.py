"""An oracle a selection change cannot fool (issue 21 item 6): the selective prefill written ONLY
with transformers' own SmolLM2 modules reproduces the project's first-token logits to 1e-4 for
any selection, with and without the APE-style correction of linked keys, with the template/system
prefix linked from the prefix cache (the reference runner's default) and without it.

The oracle owns every step: each document's KV comes from the HF model's own forward over its
canonical context (a `DynamicCache`), is moved to its new positions with the model's own rotary
embedding (R(p_new - p_old)), the leading text tokens the plan does not recompute (the linked
prefix) get the KV of the HF model's own forward over those prompt tokens, and the recomputed
tokens run through the HF decoder layers
(`LlamaDecoderLayer.__call__`: norms, projections, RoPE, MLP) with a slot-writing cache and an
attention function registered with transformers' `AttentionInterface` (eager, a 4-D mask causal
by prompt index; the correction multiplies the linked group's log-sum-exp by S). Only the plan
(token ids, positions, which tokens are recomputed) is taken from the project.
"""

from __future__ import annotations

import math

import pytest
import torch

from mpic.linker.policies.base import Policy

pytestmark = pytest.mark.slow


class _SlotCache:
    """Duck-typed HF cache: `update` writes the fresh K/V of the recomputed tokens into their
    prompt slots and returns the whole prompt's K/V of that layer."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], slots: torch.Tensor):
        self.keys, self.values, self.slots = keys, values, slots

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        self.keys[layer_idx][:, :, self.slots] = key_states
        self.values[layer_idx][:, :, self.slots] = value_states
        return self.keys[layer_idx], self.values[layer_idx]


def _oracle_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
    """Eager attention; with `oracle_linked` (bool [N]) and `oracle_scale` S != 1 the linked
    keys' log-sum-exp is multiplied by S before merging with the rest. `oracle_scale` is one S
    or (S of the first half of the layers, S of the second half)."""
    from transformers.models.llama.modeling_llama import repeat_kv

    k = repeat_kv(key, module.num_key_value_groups).double()
    v = repeat_kv(value, module.num_key_value_groups).double()
    scores = torch.matmul(query.double(), k.transpose(2, 3)) * scaling + attention_mask.double()
    s, linked = kw.get("oracle_scale", 1.0), kw.get("oracle_linked")
    if isinstance(s, tuple):
        s = s[0] if module.layer_idx < module.config.num_hidden_layers // 2 else s[1]
    if s != 1.0 and linked is not None and bool(linked.any()):
        a = scores.masked_fill(~linked, -math.inf)
        b = scores.masked_fill(linked, -math.inf)
        lse_a, lse_b = torch.logsumexp(a, -1), torch.logsumexp(b, -1)
        out_a = torch.matmul(torch.softmax(a, -1).nan_to_num(0.0), v)
        out_b = torch.matmul(torch.softmax(b, -1), v)
        wa = torch.exp(s * lse_a - torch.maximum(s * lse_a, lse_b)).nan_to_num(0.0)
        wb = torch.exp(lse_b - torch.maximum(s * lse_a, lse_b))
        out = (wa[..., None] * out_a + wb[..., None] * out_b) / (wa + wb)[..., None]
    else:
        out = torch.matmul(torch.softmax(scores, -1), v)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def oracle_logits(model, plan, entries, scale: float | tuple[float, float]) -> torch.Tensor:
    """First-token logits of `plan` (its recompute depths 0 or L) computed with HF modules only;
    scale: S, or (S of the first half of the layers, S of the second half)."""
    from transformers import AttentionInterface, DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    lm = model.model
    cfg = model.config
    layers, n = cfg.num_hidden_layers, plan.num_tokens
    hkv, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    keys = [torch.zeros(1, hkv, n, d) for _ in range(layers)]
    values = [torch.zeros(1, hkv, n, d) for _ in range(layers)]
    for e_idx, entry in enumerate(entries):  # each document's KV from its canonical prefill
        ctx, own = entry.extra["context_token_ids"], entry.extra["token_ids"]
        cache = DynamicCache()
        lm(input_ids=torch.tensor([ctx + own]), past_key_values=cache, use_cache=True)
        slots = torch.nonzero(plan.source_entry == e_idx).flatten()
        offsets = plan.source_offset[slots]
        old = len(ctx) + offsets
        delta = plan.positions[slots] - old
        x = torch.zeros(1, slots.numel(), d)
        cos, sin = lm.rotary_emb(x, delta[None])
        for layer in range(layers):
            k = cache.layers[layer].keys[:, :, len(ctx) + offsets]
            k, _ = apply_rotary_pos_emb(k, k, cos, sin)
            keys[layer][:, :, slots] = k
            values[layer][:, :, slots] = cache.layers[layer].values[:, :, len(ctx) + offsets]
    prefix = torch.nonzero(plan.is_text & (plan.recompute_depth == 0)).flatten()
    if prefix.numel():  # the linked prefix: the prompt's own first P tokens, plainly
        p = prefix.numel()
        assert torch.equal(prefix, torch.arange(p)), "unrecomputed text is a leading run"
        cache = DynamicCache()
        lm(input_ids=plan.token_ids[:p][None], past_key_values=cache, use_cache=True)
        for layer in range(layers):
            keys[layer][:, :, :p] = cache.layers[layer].keys
            values[layer][:, :, :p] = cache.layers[layer].values
    run = torch.nonzero(plan.recompute_depth > 0).flatten()
    assert bool((plan.recompute_depth[run] == layers).all()), "depths 0 or L only"
    linked = (plan.source_entry >= 0) & (plan.recompute_depth == 0)
    mask = torch.full((run.numel(), n), -math.inf)
    mask[torch.arange(n)[None, :] <= run[:, None]] = 0.0
    hidden = lm.embed_tokens(plan.token_ids[run])[None]
    cos_sin = lm.rotary_emb(hidden, plan.positions[run][None])
    cache = _SlotCache(keys, values, run)
    AttentionInterface.register("mpic_oracle", _oracle_attention)
    saved = cfg._attn_implementation
    cfg._attn_implementation = "mpic_oracle"
    try:
        for layer in lm.layers:
            hidden = layer(
                hidden,
                attention_mask=mask[None, None],
                past_key_values=cache,
                position_embeddings=cos_sin,
                oracle_linked=linked,
                oracle_scale=scale,
            )
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
    finally:
        cfg._attn_implementation = saved
    return model.lm_head(lm.norm(hidden[:, -1]))[0].float()


class _Given(Policy):
    """Depths given from outside (an arbitrary selection)."""

    name = "given"

    def __init__(self, depth: torch.Tensor) -> None:
        self.depth = depth

    def depths(self, plan, entries, num_layers):
        return self.depth


@pytest.mark.parametrize(
    "policy",
    [
        "scout-0.3:s0.8",
        "scout-0.3:s1",
        "scout-0.15:s0.7",
        "scout-0.3:s0.9/0.8",
        "scout-0.2",
        "mpic-8",
    ],
)
@pytest.mark.parametrize("link_prefix", [True, False])
@torch.inference_mode()
def test_oracle_reproduces_the_projects_logits(smollm2_question, policy, link_prefix):
    from mpic.linker.policies import get_policy

    runner, parts = smollm2_question
    prefixes = runner.prefixes
    if not link_prefix:
        runner.prefixes = None
    try:
        pre = runner.prefill(parts, policy)
    finally:
        runner.prefixes = prefixes
    assert (pre.cached_prefix > 0) == link_prefix  # SmolLM2's template: 24 tokens
    rule = get_policy(policy)
    scale = (rule.scale, rule.late_scale) if policy.startswith("scout-") else 1.0
    want = oracle_logits(runner.model, pre.plan, runner.plan(parts, "full").entries, scale)
    assert (pre.logits - want).abs().max() < 1e-4


@pytest.mark.parametrize("seed", [0, 1])
@torch.inference_mode()
def test_oracle_on_random_selections_with_the_correction(smollm2_question, seed):
    """Any selection: random item tokens recomputed, then the correction's scale from the
    `scout-*` policy applied by hand through the linked KV."""
    runner, parts = smollm2_question
    planned = runner.plan(parts, "full")
    plan, layers = planned.plan, runner.adapter.num_layers
    g = torch.Generator().manual_seed(seed)
    chosen = plan.is_text | (torch.rand(plan.num_tokens, generator=g) < 0.25)
    depth = torch.where(chosen, layers, 0)
    pre = runner.prefill(parts, _Given(depth))
    want = oracle_logits(runner.model, pre.plan, planned.entries, 1.0)
    assert (pre.logits - want).abs().max() < 1e-4
    from mpic.linker.kv.dense import DenseLinkedKV
    from mpic.linker.pipeline import link_and_prefill
    from mpic.linker.recipe import with_policy

    class _GivenCorrected(_Given):
        def correction(self, plan, num_layers, entries=()):
            from mpic.linker.correction import LinkCorrection

            return LinkCorrection(0.75, ~plan.is_text, plan.recompute_depth.clone())

    a = runner.adapter
    kv = DenseLinkedKV(layers, plan.num_tokens, a.num_kv_heads, a.head_dim)
    out = link_and_prefill(
        a, with_policy(plan, planned.entries, _GivenCorrected(depth), layers), kv
    )
    want = oracle_logits(runner.model, out.plan, planned.entries, 0.75)
    assert (out.result.logits - want).abs().max() < 1e-4
