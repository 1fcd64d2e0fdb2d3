"""The compressed KV a request decodes over (reference-runner process, after the press).

Per layer l and KV head h it holds C_l compressed prompt entries (C_l may differ per layer:
MEDA's budgets; the kept tokens may differ per head: SnapKV, MM-ShiftKV), then the decoded
tokens' K/V appended as they come. The dense prompt-length KV is dropped once this exists, so
the memory held while decoding is sum_l (C_l + max_new_tokens) * H_kv * D * 2 values.

It implements the `LinkedKV` calls decoding makes (`write` of the one new token, `attend` of its
query), so `mpic.linker.selective_prefill.run_layers` decodes over it unchanged. Every held
entry precedes the decoded query, so decode attention needs no mask:
softmax(q K_l^T / sqrt(D)) V_l over the layer's live entries, query head j on KV head
j // (H / H_kv). `evict(layer, slot)` removes one entry (Elastic Cache's fixed-point
elimination, paper Eq. 5).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class CompressedKV:
    """Per-layer compressed KV with room for `extra` decoded tokens per layer.

    keys/values: one [H_kv, C_l, D] tensor per layer (post-RoPE keys)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], extra: int) -> None:
        self.lengths = [int(k.shape[1]) for k in keys]
        """Live entries per layer (compressed prompt + decoded, minus evicted)."""
        self.prompt_lengths = list(self.lengths)
        """C_l: compressed prompt entries per layer."""
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for k, v in zip(keys, values, strict=True):
            h, c, d = k.shape
            kk = k.new_zeros(h, c + extra, d)
            vv = v.new_zeros(h, c + extra, d)
            kk[:, :c], vv[:, :c] = k, v
            self.keys.append(kk)
            self.values.append(vv)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def nbytes(self) -> int:
        """Bytes of KV storage held (allocated, both K and V, all layers)."""
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values, strict=True))

    def live_bytes(self) -> int:
        """Bytes of the live entries only."""
        per = [k.shape[0] * k.shape[2] * k.element_size() * 2 for k in self.keys]
        return sum(p * n for p, n in zip(per, self.lengths, strict=True))

    def write(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append decoded tokens k, v [S, H_kv, D] (their prompt indices are not needed)."""
        n, s = self.lengths[layer], k.shape[0]
        self.keys[layer][:, n : n + s] = k.transpose(0, 1).to(self.keys[layer].dtype)
        self.values[layer][:, n : n + s] = v.transpose(0, 1).to(self.values[layer].dtype)
        self.lengths[layer] = n + s

    def read_keys(self, layer: int, index: torch.Tensor) -> torch.Tensor:
        """Live entries `index` (slots, not prompt indices) of `layer`: [S, H_kv, D]."""
        return self.keys[layer][:, index.to(self.keys[layer].device)].transpose(0, 1)

    def attend(self, layer: int, q: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Decode queries q [S, H, D] (S new tokens, in order) over the live entries -> [S, H, D].
        The last S live entries are the queries' own tokens: causal among themselves."""
        n, s = self.lengths[layer], q.shape[0]
        k, v = self.keys[layer][:, :n], self.values[layer][:, :n]
        mask = None  # one query (decoding) sees every live entry
        if s > 1:
            mask = torch.ones(s, n, dtype=torch.bool, device=q.device)
            mask[:, n - s :] = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
            mask = mask[None]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).to(k.dtype), k, v, attn_mask=mask, enable_gqa=True
        )
        return out.transpose(0, 1).to(q.dtype)

    def evict(self, slot: int) -> None:
        """Remove live entry `slot` of every layer (later entries shift down by one)."""
        for layer in range(self.num_layers):
            n = self.lengths[layer]
            if not 0 <= slot < n:
                continue
            k, v = self.keys[layer], self.values[layer]
            k[:, slot : n - 1] = k[:, slot + 1 : n].clone()
            v[:, slot : n - 1] = v[:, slot + 1 : n].clone()
            self.lengths[layer] = n - 1
