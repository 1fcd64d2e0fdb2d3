"""MM-ShiftKV (Shu et al.): prefill-only KV selection with decode-aware query proxies
(reference-runner process).

- Eq. 4: mu_pre = mean(h), sigma_pre = std(h) element-wise over the prompt's hidden states at
  layer l (`LayerStats.hidden_mean/std`: the layer inputs of the tokens the selective prefill
  ran);
- Eq. 5: N proxy hidden states H~_i ~ N(mu_pre, diag((gamma sigma_pre)^2)), gamma > 1 the
  variance expansion factor;
- Eq. 6: q~_i = W_Q H~_i, "assigned synthetic future positions and encoded using the model's
  RoPE" (we project through the layer's own input norm + W_Q + RoPE, `attention_inputs`, at
  positions next_position + i);
- Eq. 7: a_t(q~_i) = softmax(q~_i^T k_t / sqrt(d)) over the prompt keys t;
- Eq. 8: the N proxies in G groups; a-bar_t^(g) = sum_{i in group g} a_t(q~_i); for GQA the
  query heads of one KV head are summed ("aggregating the scores of query heads belonging to the
  same key-value head");
- Eq. 9: S_g = the smallest set of keys with sum_{t in S_g} a-bar_t >= tau sum_t a-bar_t;
- Eq. 10: vote(t) = sum_g 1[t in S_g];
- Eq. 11: S_t = vote(t) + lambda a_t(q_last): the last real prefill query's attention breaks
  ties; "the top C - 1 keys ranked by S_t ... and the most recent token is always kept",
  per layer and KV head.

Defaults (section 4): N = 512 proxies, G = 32 groups of 16, gamma = 10, tau = 0.95, lambda = 1.
Proxies are sampled from a generator seeded per layer, so a request's selection is reproducible.
"""

from __future__ import annotations

import torch

from mpic.presses.base import PressContext, ScorerPress
from mpic.presses.observe import LayerStats


class MMShiftKVPress(ScorerPress):
    """proxies N, groups G, gamma, tau, lam (lambda), seed of the proxy sampler."""

    name = "mm-shiftkv"

    def __init__(
        self,
        proxies: int = 512,
        groups: int = 32,
        gamma: float = 10.0,
        tau: float = 0.95,
        lam: float = 1.0,
        seed: int = 0,
    ) -> None:
        if proxies % groups:
            raise ValueError("proxies must be a multiple of groups")
        self.proxies, self.groups, self.gamma, self.tau, self.lam = proxies, groups, gamma, tau, lam
        self.seed = seed

    def proxy_queries(self, layer: int, stats: LayerStats, ctx: PressContext) -> torch.Tensor:
        """Eq. 5-6: [N, H, D] proxy queries at future positions."""
        a = ctx.adapter
        if a is None or stats.hidden_sum is None:
            raise ValueError("mm-shiftkv needs the prefill's hidden-state statistics")
        gen = torch.Generator().manual_seed(self.seed + layer)
        mu, sigma = stats.hidden_mean, stats.hidden_std
        noise = torch.randn(self.proxies, mu.numel(), generator=gen)
        hidden = (mu + self.gamma * sigma * noise).to(a.device, a.dtype)
        pos = torch.arange(self.proxies) + ctx.next_position
        if ctx.mrope:
            pos = pos.expand(3, -1)
        q, _, _ = a.attention_inputs(layer, hidden, pos.to(a.device))
        return q

    def score(
        self,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        stats: LayerStats,
        ctx: PressContext,
    ) -> torch.Tensor:
        """[H_kv, N]: Eq. 7-11."""
        q = self.proxy_queries(layer, stats, ctx).float()  # [P, H, D]
        k = keys.float().to(q.device)  # [H_kv, N, D]
        h_kv, n, d = k.shape
        group_heads = q.shape[1] // h_kv
        size = self.proxies // self.groups
        votes = torch.zeros(h_kv, n)
        for g in range(self.groups):
            qg = q[g * size : (g + 1) * size]  # [g, H, D]
            logits = torch.einsum("ghd,hnd->ghn", qg, k.repeat_interleave(group_heads, 0))
            a = torch.softmax(logits / d**0.5, dim=-1)  # Eq. 7
            mass = a.sum(0).view(h_kv, group_heads, n).sum(1).cpu()  # Eq. 8 [H_kv, N]
            order = torch.argsort(mass, dim=-1, descending=True)
            sorted_mass = torch.gather(mass, 1, order)
            cum = sorted_mass.cumsum(-1)
            need = self.tau * mass.sum(-1, keepdim=True)
            # smallest prefix reaching tau of the mass: entries before the first cum >= need
            in_set = (cum - sorted_mass) < need  # Eq. 9
            chosen = torch.zeros_like(in_set)
            chosen.scatter_(1, order, in_set)
            votes += chosen.float()  # Eq. 10
        return votes + self.lam * stats.last_probs.float()  # Eq. 11

    def forced(self, ctx: PressContext, keep: int) -> torch.Tensor | None:
        f = torch.zeros(ctx.num_tokens, dtype=torch.bool)
        f[ctx.num_tokens - 1] = True
        return f
