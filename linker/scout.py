"""The scouting pass of query-aware selection (linker; reference runner and vLLM worker, inside
`link_and_prefill`, before the one selective pass).

ProphetKV-style relevance to the user query, in one cheap pass: the prompt's text tokens (the
tokens the plan recomputes anyway: instructions, headers, the question) run through the first
`max(layers) + 1` decoder layers over the linked item KV (cached, rotated; exactly the state the
selective prefill starts from). At each scoring layer l the attention probabilities of the
scoring rows r (the text after the last item: the question, then the chat template's assistant
header, whose LAST row is the one that produces the first output token) over every visible key
are computed from the same q and keys, and every item token j gets

    score_j = sum_{l in layers} mean_h [ p_{l,h}(last row, j)
                                         + w_q * mean_{r in question rows} p_{l,h}(r, j) ]

(w_q = `question_weight`; 0 by default: on SmolLM2 the last row alone scored best at 20-30%
recomputed, and then only that row's attention is computed). The item keys are the ones just
linked (`mpic.linker.link.linked_items`: rotated once to this prompt's positions, for the linked
KV and the scout alike), the text keys come from the pass itself, so nothing is read back from
the linked KV (the paged CPU cache is opaque). The text K/V the scout writes
are overwritten by the selective prefill, which recomputes text at every layer; item slots are
not touched.

Cost: `tokens` queries x `layers_run` layers (reported in `ScoutReport`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mpic.linker.contracts import LayerAdapter
from mpic.linker.link import LinkedItems, gather_input_embeds
from mpic.linker.linked_kv import LinkedKV
from mpic.types import CacheEntry, LinkPlan


@dataclass(frozen=True)
class ScoutReport:
    """What the scouting pass cost."""

    layers_run: int
    """Leading decoder layers the scout tokens ran through."""
    tokens: int
    """Tokens that ran (the plan's recomputed text)."""
    scoring_layers: tuple[int, ...]
    """Layers whose attention was scored."""


def scoring_rows(plan: LinkPlan, index: torch.Tensor) -> torch.Tensor:
    """int64 rows of `index` (the scout tokens) after the plan's last item token: the question
    and the template tail (always contains the last prompt token)."""
    items = torch.nonzero(~plan.is_text).flatten()
    last_item = int(items[-1]) if items.numel() else -1
    return torch.nonzero(index.cpu() > last_item).flatten()


def scout_scores(
    adapter: LayerAdapter,
    plan: LinkPlan,
    entries: Sequence[CacheEntry],
    linked_kv: LinkedKV,
    layers: Sequence[int],
    items: LinkedItems | None,
    question_weight: float = 0.0,
) -> tuple[torch.Tensor, ScoutReport]:
    """Scores float32 [N] (0 for text) of every item token, and the scout's cost.

    plan: the pre-scout plan (depth L for the tokens the scout runs: text and the last token);
    linked_kv: already linked (`link_entries`) with every item token's cached KV; items: that
    K/V (`mpic.linker.link.linked_items(..., every_item=True)`; None: the plan has no item).
    """
    num_layers = adapter.num_layers
    scoring = sorted({min(max(int(x), 0), num_layers - 1) for x in layers})
    run_to = scoring[-1] + 1
    index = torch.nonzero(plan.recompute_depth >= num_layers).flatten()
    scores = torch.zeros(plan.num_tokens, dtype=torch.float32)
    rows = scoring_rows(plan, index)
    if question_weight == 0.0:
        rows = rows[-1:]  # the last prompt row only
    if index.numel() == 0 or rows.numel() == 0 or items is None:
        return scores, ScoutReport(0, 0, tuple(scoring))
    dev = adapter.device
    item_idx = items.slots
    item_dev = item_idx.to(dev)
    item_k = items.keys[torch.as_tensor(scoring, device=items.keys.device)].to(dev)
    hidden = gather_input_embeds(adapter, plan, entries, index)
    idx, pos = index.to(dev), plan.positions[..., index].to(dev)
    weights = torch.full((rows.numel(),), question_weight / max(rows.numel() - 1, 1))
    weights[-1] = 1.0  # the last prompt row
    weights = weights.to(dev)
    rows_d = rows.to(dev)
    n_heads, n_kv = adapter.num_heads, adapter.num_kv_heads
    group = n_heads // n_kv
    total = torch.zeros(item_idx.numel(), dtype=torch.float32, device=dev)
    for layer in range(run_to):
        q, k, v = adapter.attention_inputs(layer, hidden, pos)
        linked_kv.write(layer, idx, k, v)
        if layer in scoring:
            keys = torch.zeros(
                (plan.num_tokens, n_kv, adapter.head_dim), dtype=torch.float32, device=dev
            )
            keys[item_dev] = item_k[scoring.index(layer)].float()
            keys[idx] = k.float()
            qr = q[rows_d].float().transpose(0, 1)  # [H, R, D]
            kh = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, N, D]
            logits = torch.matmul(qr, kh.transpose(1, 2)) * adapter.head_dim**-0.5
            visible = torch.arange(plan.num_tokens, device=dev)[None, :] <= idx[rows_d][:, None]
            probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
            per_key = (probs.mean(dim=0) * weights[:, None]).sum(dim=0)  # [N]
            total += per_key[item_dev]
        if layer + 1 < run_to:
            attn = linked_kv.attend(layer, q, idx)
            hidden = adapter.attention_output_and_mlp(layer, hidden, attn)
    scores[item_idx] = total.cpu()
    return scores, ScoutReport(run_to, int(index.numel()), tuple(scoring))
