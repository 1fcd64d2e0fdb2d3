"""A tiny pure-torch Llama-like decoder implementing `LayerAdapter`, for linker tests that need
no HF model; `reference_forward` is a plain causal prefill written independently of the linker."""

from __future__ import annotations

import torch

from mpic.kernels.rope import apply_rotation, rope_angles
from mpic.model_spec import RopeSpec
from mpic.types import CacheEntry


class ToyAdapter:
    """L layers of RMSNorm -> GQA attention with RoPE -> RMSNorm -> gated MLP, random weights."""

    def __init__(self, mrope: bool = False, num_layers: int = 3, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim = num_layers, 4, 2, 8
        self.hidden, self.vocab = 32, 64
        self.rope = RopeSpec(head_dim=8, theta=100.0, mrope_section=(1, 1, 2) if mrope else None)
        self.dtype, self.device = torch.float32, torch.device("cpu")

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) * 0.3

        h, d = self.hidden, self.head_dim
        self.embed = w(self.vocab, h) * 3
        self.layers = [
            dict(
                wq=w(h, 4 * d),
                wk=w(h, 2 * d),
                wv=w(h, 2 * d),
                wo=w(4 * d, h),
                up=w(h, 48),
                gate=w(h, 48),
                down=w(48, h),
            )
            for _ in range(num_layers)
        ]
        self.head = w(h, self.vocab)

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed[token_ids]

    def attention_inputs(self, layer, hidden, positions):
        p, x = self.layers[layer], self._norm(hidden)
        s = hidden.shape[0]
        q = (x @ p["wq"]).view(s, 4, 8)
        k = (x @ p["wk"]).view(s, 2, 8)
        v = (x @ p["wv"]).view(s, 2, 8)
        angles = rope_angles(positions, self.rope)
        return apply_rotation(q, angles), apply_rotation(k, angles), v

    def attention_output_and_mlp(self, layer, hidden, attn_out):
        p = self.layers[layer]
        hidden = hidden + attn_out.reshape(hidden.shape[0], -1) @ p["wo"]
        x = self._norm(hidden)
        return hidden + (torch.nn.functional.silu(x @ p["gate"]) * (x @ p["up"])) @ p["down"]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self._norm(hidden) @ self.head).float()


def reference_forward(adapter: ToyAdapter, embeds: torch.Tensor, positions: torch.Tensor):
    """Plain causal prefill: logits [N, vocab] and post-RoPE keys/values [L, N, H_kv, D]."""
    n, hidden, keys, values = embeds.shape[0], embeds, [], []
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for layer in range(adapter.num_layers):
        q, k, v = adapter.attention_inputs(layer, hidden, positions)
        keys.append(k)
        values.append(v)
        kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) / adapter.head_dim**0.5
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        attn = torch.einsum("hqk,khd->qhd", weights, vv)
        hidden = adapter.attention_output_and_mlp(layer, hidden, attn)
    return adapter.logits(hidden), torch.stack(keys), torch.stack(values)


def toy_entry(adapter, entry_id, context_ids, image_embeds, positions, fingerprint="toy"):
    """A cache entry computed by `reference_forward` over [context text + image]."""
    c = len(context_ids)
    embeds = torch.cat([adapter.embed_tokens(torch.tensor(context_ids)), image_embeds])
    _, keys, values = reference_forward(adapter, embeds, positions)
    return CacheEntry(
        entry_id=entry_id,
        model_fingerprint=fingerprint,
        keys=keys[:, c:],
        values=values[:, c:],
        positions=positions[..., c:],
        input_embeds=image_embeds,
        extra={"context_token_ids": list(context_ids)},
    )


IMAGE_ID = 5
CONTEXT = [1, 2, 3]


def toy_spec(adapter: ToyAdapter, max_model_len: int = 256):
    """A hand-made ModelSpec matching the toy adapter (family from its rope)."""
    from mpic.model_spec import ModelSpec

    return ModelSpec(
        family="qwen2-vl" if adapter.rope.mrope_section else "llava",
        path="toy",
        fingerprint="toy",
        num_layers=adapter.num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        hidden_size=adapter.hidden,
        vocab_size=adapter.vocab,
        max_model_len=max_model_len,
        rope=adapter.rope,
        image_token_id=IMAGE_ID,
    )


def grid_positions(start: int, rows: int, cols: int, mrope: bool) -> torch.Tensor:
    """Positions of an image laid out at text position `start` (independent of the linker)."""
    if not mrope:
        return torch.arange(start, start + rows * cols)
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    return torch.stack(
        [torch.full((rows * cols,), start), start + r.flatten(), start + c.flatten()]
    )


def toy_entries(adapter: ToyAdapter) -> dict[str, CacheEntry]:
    """Two images (2x3 and 2x2 grids) cached after CONTEXT."""
    mrope = adapter.rope.mrope_section is not None
    g = torch.Generator().manual_seed(7)
    out = {}
    for name, (rows, cols) in {"img-a": (2, 3), "img-b": (2, 2)}.items():
        embeds = torch.randn(rows * cols, adapter.hidden, generator=g)
        ctx_pos = torch.arange(len(CONTEXT))
        ctx_pos = ctx_pos.expand(3, -1) if mrope else ctx_pos
        pos = torch.cat([ctx_pos, grid_positions(len(CONTEXT), rows, cols, mrope)], dim=-1)
        out[name] = toy_entry(adapter, name, CONTEXT, embeds, pos)
    return out
