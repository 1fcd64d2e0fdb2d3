"""APE-style attention correction for linked (reused, not recomputed) keys (kernels; runs wherever
the selective attention runs: reference runner, vLLM worker).

Linked item KV was computed in the item's own canonical context, so in a new prompt the linked
keys draw too much attention (APE, Yang et al., ICLR'25, section 3: parallel-encoded contexts get
larger attention mass than when encoded sequentially; its fix rescales the contexts'
attention "by a scaling factor S" on the log-sum-exp before merging with the other segments).

The equation implemented (per layer, per query head, per query i). Let V_i = {j <= i} be the keys
the query sees, A_i = the keys in V_i that are LINKED at this layer (an item token whose cached
K/V is used, i.e. not recomputed at this layer), B_i = V_i \\ A_i (text, recomputed item tokens,
the query itself), s_j = scale * q_i . k_j, and

    lse_A = log sum_{j in A_i} exp(s_j),     lse_B = log sum_{j in B_i} exp(s_j)
    O_A   = sum_{j in A_i} softmax_A(s)_j v_j,   O_B likewise over B_i

    O_i = (exp(S * lse_A) O_A + exp(lse_B) O_B) / (exp(S * lse_A) + exp(lse_B))

i.e. the log-sum-exp of the linked group is MULTIPLIED by S (its mass Z_A becomes Z_A ** S; APE's
"scaling factor"), not shifted by log S. S = 1 is plain attention. Equivalently every linked
score gets the per-query bias (S - 1) * lse_A, which is how `corrected_attention` computes it:
one masked softmax with a bias, in float32. When A_i is empty the bias is 0 (plain attention).
The correction changes only the MIXING weights of the two groups; within a group the
distribution is unchanged, so the recomputed tokens' own fresh attention is untouched when no
key is linked (full recompute is exact under any S).

Two implementations, one equation (`AttentionBackend.attend_corrected`'s default, whatever the
backend):
- on CPU, **two fused calls**: PyTorch's CPU flash-attention kernel (the one `F.sdpa` runs
  there), which also returns each row's log-sum-exp, over the linked keys and over the rest
  (keys gathered per group, causal-by-prompt-index masks built once per query set), merged by
  `merge_groups`: about the cost of one plain attention call (`attend_groups` takes the groups'
  K/V already gathered: the vLLM worker reads them straight from its paged cache); bfloat16
  inputs run in bfloat16, any other dtype in float32;
- on CUDA the `flex` backend (the default there) runs compiled FlexAttention that returns its
  log-sum-exps, merged the same way (`FlexBackend.attend_corrected`; its tests passed on an
  H200, docs/kernels.md "Fourth run"; a call that fails to lower falls back to the next path,
  with a warning);
- otherwise the torch path here: scores materialised per chunk of 64 queries ([H, chunk, N]),
  ~20 kernels per chunk and layer. On an H100 this made the default `auto` slower than full
  recomputation (docs/kernels.md "GPU").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

CHUNK = 64
"""Queries per materialised score block (each block reads keys up to its last query only)."""


def merge_groups(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    s: float,
) -> torch.Tensor:
    """The equation of the module docstring from the two groups' outputs and log-sum-exps.

    out_*: [..., D]; lse_*: [...] (natural log; -inf for an empty group). Written as one
    interpolation, O = O_B + (O_A - O_B) * sigmoid(S * lse_A - lse_B) (the same weights:
    exp(S lse_A) / (exp(S lse_A) + exp(lse_B)) = sigmoid(S lse_A - lse_B)), a few elementwise
    ops instead of a dozen: a group with lse -inf gets weight 0, and a row whose groups are both
    empty gets their mean (both are zero there). Returns float32."""
    gap = (s * lse_a.float() - lse_b.float()).nan_to_num_(nan=0.0)  # -inf - -inf: both empty
    return torch.lerp(out_b.float(), out_a.float(), torch.sigmoid(gap)[..., None])


@dataclass
class CorrectedState:
    """Masks of one query set and one linked set, shared by every layer that has both."""

    kv_len: int
    """Keys [0, kv_len) are read (max query index + 1)."""
    chunks: list[tuple[int, int, int, torch.Tensor]]
    """(row start, row end, keys read b = the chunk's last index + 1, additive causal mask
    [C, b] (0 / -inf))."""
    linked: torch.Tensor
    """float32 [kv_len]: 1 on linked keys."""
    groups: Groups | None = None
    """The two-call CPU path's state (then `chunks` is empty)."""


@dataclass
class Groups:
    """Keys split into the linked group A and the rest B, with each group's causal mask."""

    index_a: torch.Tensor
    """int64 [N_A]: prompt indices of the linked keys in [0, kv_len)."""
    index_b: torch.Tensor
    """int64 [N_B]: the other keys (text, recomputed item tokens, the queries themselves)."""
    mask_a: torch.Tensor
    """float32 [1, 1, S, N_A]: 0 where query i sees key index_a[j] (index_a[j] <= q_index[i]),
    -inf elsewhere."""
    mask_b: torch.Tensor
    """float32 [1, 1, S, N_B], likewise."""
    sees_a: torch.Tensor
    """bool [1, S]: the query sees at least one linked key (else its lse_A is -inf)."""


def _flash_with_lse() -> Any:
    """PyTorch's CPU flash-attention op: (q, k, v, attn_mask=float mask, scale=) -> (out [B, H,
    S, D], logsumexp float32 [B, H, S]); GQA by key-head broadcasting. None if absent."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _groups(q_index: torch.Tensor, link: torch.Tensor) -> Groups:
    """`Groups` for host indices (int64 [S]) and the linked mask over [0, kv_len) (bool)."""
    index_a = torch.nonzero(link).flatten()
    index_b = torch.nonzero(~link).flatten()
    visible = [index[None, :] <= q_index[:, None] for index in (index_a, index_b)]  # [S, N_g]
    mask_a, mask_b = (torch.zeros(v.shape).masked_fill_(~v, -math.inf)[None, None] for v in visible)
    return Groups(index_a, index_b, mask_a, mask_b, visible[0].any(dim=1)[None])


def prepare_corrected(q_index: torch.Tensor, linked: torch.Tensor, num_keys: int) -> CorrectedState:
    """Build the masks for queries at q_index (int64 [S], ascending) and the linked keys (bool
    [N]); reads the last index once (host sync on a device)."""
    num_q = int(q_index.shape[0])
    kv_len = min(int(q_index[-1]) + 1, num_keys) if num_q else 0
    dev = q_index.device
    link = linked[:kv_len].to(dev)
    if dev.type == "cpu" and num_q and _flash_with_lse() is not None:
        return CorrectedState(kv_len, [], link.float(), _groups(q_index, link))
    host = q_index.cpu()
    chunks = []
    for c0 in range(0, num_q, CHUNK):
        c1 = min(c0 + CHUNK, num_q)
        b = min(int(host[c1 - 1]) + 1, kv_len)
        idx = q_index[c0:c1]
        visible = torch.arange(b, device=dev)[None, :] <= idx[:, None]
        causal = torch.zeros(visible.shape, dtype=torch.float32, device=dev)
        causal.masked_fill_(~visible, -math.inf)
        chunks.append((c0, c1, b, causal))
    return CorrectedState(kv_len, chunks, link.float())


def corrected_attention(
    q: torch.Tensor,
    q_index: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    linked: torch.Tensor,
    s: float,
    scale: float | None = None,
    state: CorrectedState | None = None,
) -> torch.Tensor:
    """Causal-by-prompt-index attention with the linked group's log-sum-exp scaled by `s`.

    q [S, H, D] at ascending prompt indices q_index (int64 [S], keys' device); keys/values
    [N, H_kv, D]; linked bool [N] (True: the key is linked, not recomputed, at this layer);
    state: `prepare_corrected(q_index, linked, N)` when the caller keeps it across layers.
    Returns [S, H, D] in q's dtype. With s == 1 it equals plain selective attention.
    """
    heads, dim = q.shape[1], q.shape[2]
    scale = dim**-0.5 if scale is None else scale
    if state is None:
        state = prepare_corrected(q_index, linked, int(keys.shape[0]))
    if state.groups is not None:
        return _two_calls(q, keys, values, s, scale, state.groups)
    kv_len = state.kv_len
    kv_heads = int(keys.shape[1])
    group = heads // kv_heads
    # GQA without copying K/V per query head: the G query heads sharing a KV head become G x C
    # rows of that head (row order (g, c); head h uses KV head h // G, as HF's repeat_kv)
    k = keys[:kv_len].float().transpose(0, 1)  # [H_kv, N, D]
    v = values[:kv_len].float().transpose(0, 1)
    # [H_kv, N, 2D]: all values, then the linked group's values only (one bmm gives both sums)
    v2 = torch.cat([v, v * state.linked[None, :, None]], dim=-1)
    outs = []
    for r0, r1, b, causal in state.chunks:
        c = r1 - r0
        qc = q[r0:r1].float().transpose(0, 1).reshape(kv_heads, group * c, dim) * scale
        mask = causal.repeat(group, 1) if group > 1 else causal  # [G * C, b]
        scores = torch.baddbmm(mask.expand(kv_heads, -1, -1), qc, k[:, :b].transpose(1, 2))
        top = scores.amax(dim=-1, keepdim=True)  # [H_kv, G*C, 1] (finite: a query sees itself)
        e = scores.sub_(top).exp_()  # exp(s - m), 0 where not visible
        z_all = e.sum(dim=-1)
        z_a = torch.matmul(e, state.linked[:b])  # sum over the linked group
        z_b = (z_all - z_a).clamp_min(torch.finfo(torch.float32).tiny)
        m = top[..., 0]
        # log-weights of the two groups: S * lse_A and lse_B (lse = m + log z)
        log_wa = s * (m + torch.log(z_a))  # -inf when the group is empty
        log_wb = m + torch.log(z_b)
        t = torch.maximum(log_wa, log_wb)
        wa, wb = torch.exp(log_wa - t), torch.exp(log_wb - t)
        total = wa + wb
        alpha = torch.where(z_a > 0, wa / (total * z_a.clamp_min(1e-38)), 0.0)  # linked keys
        beta = wb / (total * z_b)  # the rest
        both, linked_part = torch.bmm(e, v2[:, :b]).split(dim, dim=-1)  # [H_kv, G*C, D] each
        out = beta[..., None] * (both - linked_part) + alpha[..., None] * linked_part
        outs.append(out.reshape(heads, c, dim).transpose(0, 1))  # [C, H, D]
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out.to(q.dtype)


def _two_calls(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    s: float,
    scale: float,
    groups: Groups,
) -> torch.Tensor:
    """The CPU path: one flash-attention call per group (its log-sum-exp returned), merged by
    `merge_groups` in float32. q [S, H, D], keys/values [N, H_kv, D] -> [S, H, D] in q's dtype."""
    group_a = keys.index_select(0, groups.index_a), values.index_select(0, groups.index_a)
    group_b = keys.index_select(0, groups.index_b), values.index_select(0, groups.index_b)
    return attend_groups(q, group_a, group_b, s, scale, groups)


def attend_groups(
    q: torch.Tensor,
    group_a: tuple[torch.Tensor, torch.Tensor],
    group_b: tuple[torch.Tensor, torch.Tensor],
    s: float,
    scale: float,
    groups: Groups,
    lse_a_out: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """The two-call CPU path over K/V already split into the groups: group_a = the keys and
    values at `groups.index_a` ([N_A, H_kv, D] each), group_b likewise at `groups.index_b`
    (a caller that reads them straight from its own cache, e.g. a paged one, gathers only these
    rows). Same result as `corrected_attention` over the full K/V with the same `groups`.
    lse_a_out: a list that receives the linked group's log-sum-exps float32 [H, S] (-inf for a
    query that sees no linked key), e.g. for the vLLM worker's shift of the last query's keys."""
    flash = _flash_with_lse()
    # bfloat16 runs as is (the kernel accumulates in float32 and returns float32 log-sum-exps;
    # ~45% faster than casting on a CPU with AMX); any other dtype in float32
    work = torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32
    qh = q.to(work).transpose(0, 1)[None]  # [1, H, S, D]
    parts = []
    for (keys, values), mask in ((group_a, groups.mask_a), (group_b, groups.mask_b)):
        if keys.shape[0] == 0:  # an empty group: weight 0 (lse -inf)
            lse = torch.full(qh.shape[1:3], -math.inf)
            parts.append((torch.zeros(qh.shape[1:]), lse))
            continue
        k = keys.to(work).transpose(0, 1)[None]  # [1, H_kv, N_g, D]
        v = values.to(work).transpose(0, 1)[None]
        out, lse = flash(qh, k, v, attn_mask=mask, scale=scale)
        parts.append((out[0], lse[0]))
    (out_a, lse_a), (out_b, lse_b) = parts
    # a query that sees no linked key: the kernel returns lse 0 for its empty row, not -inf
    lse_a = torch.where(groups.sees_a, lse_a, -math.inf)
    if lse_a_out is not None:
        lse_a_out.append(lse_a)
    return merge_groups(out_a, lse_a, out_b, lse_b, s).transpose(0, 1).to(q.dtype)


def linked_mask(
    is_item: torch.Tensor, depth: torch.Tensor, layer: int, capacity: int
) -> torch.Tensor:
    """bool [capacity]: the keys linked (not recomputed) at `layer`: item tokens whose recompute
    depth is <= layer. is_item bool [N], depth int64 [N] (N <= capacity; slots past N, decoded
    tokens, are fresh)."""
    out = torch.zeros(capacity, dtype=torch.bool, device=is_item.device)
    n = int(is_item.shape[0])
    out[:n] = is_item & (depth <= layer)
    return out
