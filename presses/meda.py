"""MEDA: entropy-guided dynamic KV allocation for multimodal decoding (reference-runner process).

- Eq. 4: A_TV = Softmax(Q_T K_V^T / sqrt(D)), A_VT = Softmax(Q_V K_T^T / sqrt(D));
- Eq. 5-6: E_TV = (1/|T|) sum_i sum_j A_TV log A_TV, E_VT likewise, E_CM = -(E_TV + E_VT), with
  A head-averaged per layer (`LayerStats.entropy_cm`; under MPIC's selective prefill the visual
  queries are the recomputed image tokens);
- Eq. 7: S_l = alpha_l * S, alpha_l = exp(E_CM^l) / sum_k exp(E_CM^k) * L * rho (the paper's
  "inverse entropy softmax allocation": layers with more diffuse cross-modal attention get
  more cache). S = N (the full per-layer size) and rho = the budget, so sum_l S_l = L rho N;
  we round to integers keeping that sum exactly (largest remainder) and cap each layer at N,
  handing the excess to the other layers in the same proportions;
- Eq. 8: A_s = sum_i A_p[i, :] (`LayerStats.colsum`, head-averaged: one selection per layer);
- Eq. 9: A_s[T] += max(A_s) for text tokens (text prior);
- Eq. 10: K_c = [K[I]; K[-M:]], I = TopN(A_s[:-M]): a recent window of M tokens plus the top
  N = S_l - M others. The paper does not state M; we use M = 32 (capped at S_l);
- Eq. 11-12: every other token merges into its most cosine-similar conserved key (per head,
  similarity on keys only, the same assignment for values):
  k_j <- (k_j + sum_{i in N_j} k_i) / (|N_j| + 1).
"""

from __future__ import annotations

import torch

from mpic.presses.base import PressContext, ScorerPress, keep_count, merge_into
from mpic.presses.observe import LayerStats


def allocate(weights: torch.Tensor, total: int, cap: int, floor: int = 1) -> list[int]:
    """Integers S_l >= floor, <= cap, summing to `total`, proportional to weights [L]
    (largest remainder; capped layers' excess goes to the rest proportionally)."""
    n_layers = weights.numel()
    total = max(min(total, cap * n_layers), floor * n_layers)
    out = torch.full((n_layers,), floor, dtype=torch.long)
    free = torch.ones(n_layers, dtype=torch.bool)
    left = total - int(out.sum())
    w = weights.double().clamp_min(0)
    while left > 0 and bool(free.any()):
        ww = torch.where(free, w, torch.zeros_like(w))
        ww = ww / ww.sum() if float(ww.sum()) > 0 else free.double() / float(free.sum())
        share = ww * left
        add = share.floor().long()
        rem = left - int(add.sum())
        order = torch.argsort(share - add, descending=True)
        for i in order[:rem].tolist():
            add[i] += 1
        new = torch.minimum(out + add, torch.tensor(cap))
        left = total - int(new.sum())
        free = new < cap
        out = new
    return out.tolist()


class MEDAPress(ScorerPress):
    """recent_window: M of Eq. 10; merge: Eq. 11-12 merging (False: selection only, the
    ablation in docs/presses.md)."""

    name = "meda"

    def __init__(self, recent_window: int = 32, merge: bool = True) -> None:
        self.recent_window, self.merge = recent_window, merge

    def layer_budgets(self, stats: list[LayerStats], ctx: PressContext, budget: float) -> list[int]:
        """Eq. 7 per-layer sizes S_l; sum = L * round(rho * N)."""
        ent = torch.tensor([s.entropy_cm for s in stats], dtype=torch.float64)
        alpha = torch.softmax(ent, 0)
        total = keep_count(budget, ctx.num_tokens) * len(stats)
        return allocate(alpha, total, ctx.num_tokens)

    def score(
        self,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        stats: LayerStats,
        ctx: PressContext,
    ) -> torch.Tensor:
        """[N]: Eq. 8-9 accumulated attention with the text prior."""
        s = stats.colsum.float().mean(0)
        text = ~ctx.is_visual.cpu()
        return torch.where(text, s + s.max(), s)

    def forced(self, ctx: PressContext, keep: int) -> torch.Tensor | None:
        f = torch.zeros(ctx.num_tokens, dtype=torch.bool)
        f[ctx.num_tokens - min(self.recent_window, keep) :] = True
        return f

    def compress_layer(
        self,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        stats: LayerStats,
        keep: int,
        ctx: PressContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kept = self.select(layer, keys, values, stats, keep, ctx)  # [C] ascending
        if not self.merge:
            return keys[:, kept.to(keys.device)], values[:, kept.to(keys.device)]
        target = nearest_kept_by_cosine(keys, kept)
        return merge_into(keys, values, target, kept)


def nearest_kept_by_cosine(keys: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Eq. 11: slot (0..C-1) of the most cosine-similar kept key for every token, per head;
    kept tokens map to their own slot. keys [H_kv, N, D], kept [C] -> int64 [H_kv, N]."""
    h, n, _ = keys.shape
    kn = torch.nn.functional.normalize(keys.float(), dim=-1)
    kept_d = kept.to(keys.device)
    sim = torch.einsum("hnd,hcd->hnc", kn, kn[:, kept_d])  # [H_kv, N, C]
    target = sim.argmax(-1)
    own = torch.arange(kept.numel(), device=keys.device)
    target[:, kept_d] = own[None].expand(h, -1)
    return target
