"""The press contract: compress one prompt's KV after the linked prefill, before decoding
(reference-runner process; the uniform-across-layers variant, `ScorerPress.uniform_keep`, also
runs in the vLLM worker: `mpic.presses.entries`).

The shape follows NVIDIA kvpress: a `BasePress` compresses one layer's K/V given what the
prefill saw, a `ScorerPress` scores every prompt token and keeps the best. Here the prefill is
MPIC's selective one, so "what the prefill saw" is `mpic.presses.observe.LayerStats` (attention
of the queries that ran, hidden-state statistics) plus `PressContext` (positions, the adapter for
presses that project new queries). Shapes: keys/values [H_kv, N, D] per layer (post-RoPE keys),
N = prompt tokens.

Budget: a fraction b in (0, 1] of the prompt's KV. Unless a press allocates per layer (MEDA),
every layer keeps exactly C = max(1, round(b * N)) entries per KV head. b = 1 keeps the dense KV
untouched (the engine does not compress at all, so decoding is bit-identical to no press).
Entries are kept in prompt order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mpic.presses.cache import CompressedKV
from mpic.presses.observe import LayerStats


@dataclass
class PressContext:
    """Per-prompt facts a press may need besides the statistics."""

    num_tokens: int
    is_visual: torch.Tensor
    """bool [N]: item (image) tokens."""
    next_position: int
    """First decode position (RoPE), for presses that place synthetic queries there."""
    mrope: bool = False
    """Positions are [3, S] (M-RoPE)."""
    adapter: Any = None
    """The model's `LayerAdapter` (MM-ShiftKV projects proxy queries through it)."""


def keep_count(budget: float, n: int) -> int:
    """C = max(1, round(b * N)) prompt entries per layer."""
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget must be in (0, 1], got {budget}")
    return max(1, min(n, round(budget * n)))


class BasePress:
    """Compress one prompt's KV; subclasses implement `compress_layer` (and may override
    `layer_budgets` and `after_decode_step`)."""

    name = "base"

    def layer_budgets(self, stats: list[LayerStats], ctx: PressContext, budget: float) -> list[int]:
        """Entries kept per layer: uniform C by default."""
        return [keep_count(budget, ctx.num_tokens)] * len(stats)

    def compress_layer(
        self,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        stats: LayerStats,
        keep: int,
        ctx: PressContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """keys/values [H_kv, N, D] -> compressed [H_kv, keep, D] each."""
        raise NotImplementedError

    def compress(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        stats: list[LayerStats],
        ctx: PressContext,
        budget: float,
        extra: int,
    ) -> CompressedKV:
        """Compress every layer (keys/values: [H_kv, N, D] each) into a `CompressedKV` with room
        for `extra` decoded tokens."""
        budgets = self.layer_budgets(stats, ctx, budget)
        out_k, out_v = [], []
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            ck, cv = self.compress_layer(layer, k, v, stats[layer], budgets[layer], ctx)
            assert ck.shape[1] == budgets[layer], (self.name, layer, ck.shape, budgets[layer])
            out_k.append(ck)
            out_v.append(cv)
        return CompressedKV(out_k, out_v, extra)

    def after_decode_step(self, kv: CompressedKV, seen_tokens: int) -> None:
        """Called after each decoded token is appended (`seen_tokens` = prompt + decoded so far).
        Only Elastic Cache acts here."""


def gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [H_kv, N, D], idx int64 [H_kv, C] or [C] (shared by all heads) -> [H_kv, C, D]."""
    if idx.dim() == 1:
        return x[:, idx.to(x.device)]
    idx = idx.to(x.device)
    return torch.gather(x, 1, idx[..., None].expand(-1, -1, x.shape[-1]))


def top_indices(
    scores: torch.Tensor, keep: int, forced: torch.Tensor | None = None
) -> torch.Tensor:
    """Indices of the `keep` best scores along the last axis, ascending (prompt order).

    scores [..., N] float; forced bool [N]: tokens always kept (they count against `keep`).
    Ties are broken toward the later token (deterministic)."""
    n = scores.shape[-1]
    s = scores.float().clone()
    if forced is not None:
        s[..., forced.to(s.device)] = float("inf")
    # tie-break: a tiny increasing ramp well below any real score gap
    s = s + torch.arange(n, device=s.device, dtype=s.dtype) * 1e-12
    idx = torch.topk(s, keep, dim=-1).indices
    return torch.sort(idx, dim=-1).values


class ScorerPress(BasePress):
    """Score-then-select: keep the `keep` highest-scoring tokens per KV head (or per layer when
    `score` returns one row). Subclasses implement `score`; `forced` tokens are always kept."""

    name = "scorer"

    def score(
        self,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        stats: LayerStats,
        ctx: PressContext,
    ) -> torch.Tensor:
        """-> scores [H_kv, N] (per head) or [N] (one selection shared by the layer's heads)."""
        raise NotImplementedError

    def forced(self, ctx: PressContext, keep: int) -> torch.Tensor | None:
        """bool [N] of tokens kept regardless of score (<= keep of them), or None."""
        return None

    def select(
        self,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        stats: LayerStats,
        keep: int,
        ctx: PressContext,
    ) -> torch.Tensor:
        """Kept indices, ascending: [H_kv, keep] or [keep]."""
        return top_indices(
            self.score(layer, keys, values, stats, ctx), keep, self.forced(ctx, keep)
        )

    def compress_layer(
        self,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        stats: LayerStats,
        keep: int,
        ctx: PressContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.select(layer, keys, values, stats, keep, ctx)
        return gather_tokens(keys, idx), gather_tokens(values, idx)

    def uniform_scores(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        stats: list[LayerStats],
        ctx: PressContext,
    ) -> torch.Tensor:
        """The uniform-across-layers score of every prompt token: each layer's (and head's)
        scores shifted to a minimum of 0, normalised to sum 1, then summed over layers and
        heads. -> float32 [N] (CPU)."""
        total = torch.zeros(ctx.num_tokens)
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            s = self.score(layer, k, v, stats[layer], ctx).float().cpu()
            s = s if s.dim() == 2 else s[None]
            s = s - s.amin(-1, keepdim=True)
            total += (s / s.sum(-1, keepdim=True).clamp_min(1e-30)).sum(0)
        return total

    def uniform_keep(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        stats: list[LayerStats],
        ctx: PressContext,
        budget: float,
        span: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """The uniform-across-layers variant: ONE kept token set for all layers and heads, the
        best `uniform_scores` (the press's forced tokens first). span (a, b): choose only among
        prompt tokens [a, b) (an item's tokens, `mpic.presses.entries`), keeping
        C = max(1, round(b * (b - a))) of them; None: the whole prompt (C of N).
        -> int64 [C] ascending, relative to `a` (the engine drops the other tokens from every
        layer)."""
        a, b = span if span is not None else (0, ctx.num_tokens)
        keep = keep_count(budget, b - a)
        total = self.uniform_scores(keys, values, stats, ctx)[a:b]
        forced = self.forced(ctx, keep)
        return top_indices(total, keep, None if forced is None else forced[a:b])


def merge_into(
    keys: torch.Tensor, values: torch.Tensor, target: torch.Tensor, kept: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Average merging: every token joins the bucket of its target kept slot and each kept slot
    becomes its bucket's mean (Elastic Cache Eq. 3, MEDA Eq. 12).

    keys/values [H_kv, N, D]; target int64 [H_kv, N] (or [N]): slot 0..C-1 each token joins (a
    kept token joins its own slot); kept [H_kv, C] or [C]: only for the shape. -> [H_kv, C, D]."""
    h, n, d = keys.shape
    c = kept.shape[-1]
    if target.dim() == 1:
        target = target[None].expand(h, n)
    target = target.to(keys.device)
    idx = target[..., None].expand(h, n, d)
    count = torch.zeros(h, c, device=keys.device, dtype=torch.float32)
    count.scatter_add_(1, target, torch.ones(h, n, device=keys.device))
    out = []
    for x in (keys, values):
        acc = torch.zeros(h, c, d, device=x.device, dtype=torch.float32)
        acc.scatter_add_(1, idx, x.float())
        out.append((acc / count[..., None]).to(x.dtype))
    return out[0], out[1]
