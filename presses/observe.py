"""What the prefill saw, collected for the presses (reference-runner process, during the linked
selective prefill).

MPIC's selective prefill (docs/linker.md) runs only the recomputed tokens through the layers:
reused image tokens have keys and values but no queries. So every attention statistic a press
uses is computed from the queries that really ran (all text and the first k tokens of each image
under `mpic-k`; everything under `full`), over ALL linked keys of the layer, with the causal mask
by prompt index. `ObservedKV` wraps any `LinkedKV` and `ObservedAdapter` any `LayerAdapter`
(duck-typed: this floor cannot import the linker); the engine hands the wrapped pair to the
prefill and the `PrefillObserver` accumulates, per layer l (H_kv KV heads, N prompt tokens):

- `colsum` [H_kv, N]: sum over observed queries m of A[m, n] (Elastic Cache Eq. 1,
  I_n = sum_m A_{m,n}; MEDA Eq. 8, A_s = sum_i A_p[i, :]), query heads averaged per KV head;
- `window_colsum` [H_kv, N]: the same over the queries of the last `window` prompt indices
  (SnapKV's observation window);
- `last_probs` [H_kv, N]: attention of the last prompt token (MM-ShiftKV Eq. 11's anchor);
- `entropy_cm`: MEDA Eq. 5-6 cross-modal attention entropy, from head-averaged attention of text
  queries over visual keys (softmax over visual keys) and of visual queries over text keys;
- `hidden_mean`, `hidden_std` [hidden]: MM-ShiftKV Eq. 4 element-wise statistics of the layer's
  input hidden states over the observed prompt tokens.

Statistics are float32 and computed in chunks of queries, so the extra memory is O(chunk * N)
per layer, not O(N^2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

_CHUNK = 256


@dataclass
class LayerStats:
    """One layer's statistics (see the module docstring)."""

    colsum: torch.Tensor
    window_colsum: torch.Tensor
    last_probs: torch.Tensor
    queries: int = 0
    entropy_tv_sum: float = 0.0
    entropy_vt_sum: float = 0.0
    text_rows: int = 0
    visual_rows: int = 0
    hidden_sum: torch.Tensor | None = None
    hidden_sq: torch.Tensor | None = None
    hidden_rows: int = 0

    @property
    def entropy_cm(self) -> float:
        """MEDA Eq. 6: E_CM = -(E_TV + E_VT), each row-averaged (Eq. 5); E here already carries
        the minus sign of the entropy definition, so the sum of the two means is returned."""
        tv = self.entropy_tv_sum / self.text_rows if self.text_rows else 0.0
        vt = self.entropy_vt_sum / self.visual_rows if self.visual_rows else 0.0
        return tv + vt

    @property
    def hidden_mean(self) -> torch.Tensor:
        """MM-ShiftKV Eq. 4 mu_pre [hidden]."""
        assert self.hidden_sum is not None, "no hidden states observed"
        return self.hidden_sum / self.hidden_rows

    @property
    def hidden_std(self) -> torch.Tensor:
        """MM-ShiftKV Eq. 4 sigma_pre [hidden] (population std)."""
        mean = self.hidden_mean
        return (self.hidden_sq / self.hidden_rows - mean * mean).clamp_min(0).sqrt()


@dataclass
class PrefillObserver:
    """Accumulates `LayerStats` for one prompt of `num_tokens` tokens.

    is_visual: bool [N], True for item (image) tokens (MEDA's modality split). window: SnapKV's
    observation window (last `window` prompt indices)."""

    num_layers: int
    num_tokens: int
    num_kv_heads: int
    is_visual: torch.Tensor
    window: int = 64
    layers: list[LayerStats] = field(default_factory=list)

    def __post_init__(self) -> None:
        n, h = self.num_tokens, self.num_kv_heads
        self.layers = [
            LayerStats(torch.zeros(h, n), torch.zeros(h, n), torch.zeros(h, n))
            for _ in range(self.num_layers)
        ]
        self.is_visual = self.is_visual.cpu().bool()

    def record_hidden(self, layer: int, hidden: torch.Tensor) -> None:
        """Layer input hidden states [S, hidden] of the tokens about to run the layer."""
        st = self.layers[layer]
        h = hidden.detach().float().cpu()
        s, sq = h.sum(0), (h * h).sum(0)
        st.hidden_sum = s if st.hidden_sum is None else st.hidden_sum + s
        st.hidden_sq = sq if st.hidden_sq is None else st.hidden_sq + sq
        st.hidden_rows += h.shape[0]

    def record_attention(
        self, layer: int, q: torch.Tensor, index: torch.Tensor, keys: torch.Tensor
    ) -> None:
        """q [S, H, D] of the prompt tokens at `index` [S] over the layer's linked keys
        keys [N', H_kv, D] (N' >= N: only the first N prompt slots are scored)."""
        n, st = self.num_tokens, self.layers[layer]
        index = index.cpu()
        inside = index < n
        if not bool(inside.any()):
            return
        q, index = q[inside.to(q.device)], index[inside]
        k = keys[:n].float()  # [N, H_kv, D]
        h, h_kv, d = q.shape[1], k.shape[1], k.shape[2]
        group = h // h_kv
        key_pos = torch.arange(n)
        vis = self.is_visual
        for lo in range(0, q.shape[0], _CHUNK):
            qc, ic = q[lo : lo + _CHUNK].float(), index[lo : lo + _CHUNK]
            # logits [S_c, H, N]; query head j uses KV head j // group
            logits = torch.einsum("shd,nhd->shn", qc, k.repeat_interleave(group, dim=1))
            logits = (logits / d**0.5).cpu()
            causal = key_pos[None, :] <= ic[:, None]  # [S_c, N]
            logits = logits.masked_fill(~causal[:, None, :], float("-inf"))
            probs = torch.softmax(logits, dim=-1)  # Eq. 1
            per_kv = probs.view(probs.shape[0], h_kv, group, n).mean(2)  # [S_c, H_kv, N]
            st.colsum += per_kv.sum(0)
            in_window = ic >= n - self.window
            if bool(in_window.any()):
                st.window_colsum += per_kv[in_window].sum(0)
            last = ic == n - 1
            if bool(last.any()):
                st.last_probs = per_kv[last][0].clone()
            st.queries += qc.shape[0]
            self._entropy(st, logits, ic, causal, vis)

    @staticmethod
    def _entropy(
        st: LayerStats,
        logits: torch.Tensor,
        index: torch.Tensor,
        causal: torch.Tensor,
        vis: torch.Tensor,
    ) -> None:
        """MEDA Eq. 4-5 on one chunk: A_TV = Softmax(Q_T K_V^T / sqrt(D)) (softmax over the
        visual keys the query may see), A_VT likewise over text keys; heads averaged
        ("A is average attention across multi-heads"); rows with no key of the other modality
        are skipped."""
        q_vis = vis[index]  # [S_c]
        for rows, keys_of in ((~q_vis, vis), (q_vis, ~vis)):
            allowed = causal & keys_of[None, :]  # [S_c, N]
            rows = rows & allowed.any(1)
            if not bool(rows.any()):
                continue
            lg = logits[rows].masked_fill(~allowed[rows][:, None, :], float("-inf"))
            a = torch.softmax(lg, dim=-1).mean(1)  # [R, N], head-averaged
            plogp = torch.where(a > 0, a * a.clamp_min(1e-30).log(), torch.zeros_like(a))
            if keys_of is vis:  # text queries over visual keys: E_TV
                st.entropy_tv_sum += float(-plogp.sum())
                st.text_rows += int(rows.sum())
            else:
                st.entropy_vt_sum += float(-plogp.sum())
                st.visual_rows += int(rows.sum())


class ObservedKV:
    """A `LinkedKV` that reports every attention call of prompt tokens to an observer."""

    def __init__(self, inner: Any, observer: PrefillObserver) -> None:
        self.inner, self.observer = inner, observer

    def write(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.inner.write(layer, index, k, v)

    def write_layers(self, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.inner.write_layers(index, k, v)

    def read_keys(self, layer: int, index: torch.Tensor) -> torch.Tensor:
        return self.inner.read_keys(layer, index)

    def attend(self, layer: int, q: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        out = self.inner.attend(layer, q, index)
        n = self.observer.num_tokens
        keys = self.inner.read_keys(layer, torch.arange(n, device=index.device))
        self.observer.record_attention(layer, q, index, keys)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class ObservedAdapter:
    """A `LayerAdapter` that reports each layer's input hidden states (MM-ShiftKV Eq. 4)."""

    def __init__(self, inner: Any, observer: PrefillObserver) -> None:
        self.inner, self.observer = inner, observer

    def attention_inputs(
        self, layer: int, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.observer.record_hidden(layer, hidden)
        return self.inner.attention_inputs(layer, hidden, positions)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
