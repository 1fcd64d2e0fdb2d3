"""A `LinkedKV` over one request's paged KV blocks, using vLLM's CPU attention op (vLLM worker).

docs/design.md "Exact masks with the engine's own attention op": the reused KV already sits in the
request's blocks; the recomputed tokens form a few contiguous runs [a, b). At each layer their
fresh K/V are written into their slots (`cpu_attn_reshape_and_cache`, the portable write: the
in-block layout depends on the ISA, docs/design.md "Platform notes"), then ONE `cpu_attention_with_kv_cache`
call attends all runs, each run a "virtual sequence" of query length b - a and sequence length b
that shares the request's block table. vLLM's causal rule for a chunk (query i of a run at
position seq_len - qlen + i sees keys 0..that position) is exactly "key index <= query index".

Slot of prompt index p: `block_ids[p // block_size] * block_size + p % block_size`.
Shapes: per-layer cache [num_blocks, H_kv, block_size, 2 * D] (K region then V region).
"""

from __future__ import annotations

import torch
from torch import nn
from vllm import _custom_ops as ops
from vllm import envs


def contiguous_runs(index: torch.Tensor) -> list[tuple[int, int]]:
    """Ascending int64 [S] -> [(a, b), ...]: maximal runs with index[a:b] consecutive."""
    if index.numel() == 0:
        return []
    breaks = torch.nonzero(index[1:] - index[:-1] != 1).flatten() + 1
    edges = [0, *breaks.tolist(), int(index.numel())]
    return list(zip(edges[:-1], edges[1:], strict=True))


def _cache_format(attn: nn.Module) -> dict:
    """The KV cache's dtype and quantisation scales, as vLLM's CPU ops take them."""
    return {
        "k_scale": attn._k_scale_float,
        "v_scale": attn._v_scale_float,
        "kv_cache_dtype": attn.impl.kv_cache_dtype,
    }


class PagedLinkedKV:
    """Linked KV of one prompt living in vLLM's paged cache (one tensor per attention layer).

    `layers[l]` is vLLM's `Attention` module of decoder layer l, `caches[l]` its KV tensor,
    `block_ids` the request's blocks in order. `keys` [L, N, H_kv, D] is a dense mirror of the
    linked keys (the initial linked keys, updated by `write`), used only by `read_keys`.
    """

    def __init__(
        self,
        layers: list[nn.Module],
        caches: list[torch.Tensor],
        block_ids: list[int],
        block_size: int,
        keys: torch.Tensor | None = None,
    ) -> None:
        self._layers = layers
        self._caches = caches
        self._block_size = block_size
        self._blocks = torch.tensor(block_ids, dtype=torch.int64)
        self._block_table = self._blocks.to(torch.int32).unsqueeze(0)
        self._keys = keys

    def slots(self, index: torch.Tensor) -> torch.Tensor:
        """Prompt indices int64 [S] -> cache slots int64 [S]."""
        bs = self._block_size
        return self._blocks[index // bs] * bs + index % bs

    def clear(self) -> None:
        """Zero the request's blocks in every layer (zero is zero in any in-block layout)."""
        for cache in self._caches:
            cache[self._blocks] = 0

    def _split(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self._caches[layer]
        num_blocks, num_kv_heads, block_size, _ = cache.shape
        both = cache.view(num_blocks, num_kv_heads, block_size * 2, -1)
        key_cache, value_cache = both.chunk(2, dim=2)
        return key_cache, value_cache

    def write(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite prompt slots `index` [S] of `layer` with k, v [S, H_kv, D]."""
        attn = self._layers[layer]
        key_cache, value_cache = self._split(layer)
        ops.cpu_attn_reshape_and_cache(
            k.contiguous(),
            v.contiguous(),
            key_cache,
            value_cache,
            self.slots(index),
            attn.isa,
            **_cache_format(attn),
        )
        if self._keys is not None:
            self._keys[layer, index] = k.to(self._keys.dtype)

    def read_keys(self, layer: int, index: torch.Tensor) -> torch.Tensor:
        """The linked keys at `index` of `layer`: [S, H_kv, D] (from the dense mirror)."""
        if self._keys is None:
            raise RuntimeError("PagedLinkedKV built without a key mirror cannot read keys")
        return self._keys[layer, index]

    def attend(self, layer: int, q: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """q [S, H, D] at ascending prompt indices `index` -> [S, H, D], causal by index."""
        attn = self._layers[layer]
        impl = attn.impl
        runs = contiguous_runs(index)
        starts = torch.tensor([0] + [b for _, b in runs], dtype=torch.int32)
        seq_lens = torch.tensor([int(index[b - 1]) + 1 for _, b in runs], dtype=torch.int32)
        block_table = self._block_table.expand(len(runs), -1).contiguous()
        num_heads, head_dim = q.shape[1], q.shape[2]
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(runs),
            num_heads=num_heads,
            num_kv_heads=impl.num_kv_heads,
            head_dim=head_dim,
            seq_lens=seq_lens,
            dtype=q.dtype,
            query_start_loc=starts,
            causal=True,
            sliding_window_size=-1,
            isa=attn.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            kv_cache_dtype=impl.kv_cache_dtype,
        )
        key_cache, value_cache = self._split(layer)
        out = torch.empty_like(q)
        ops.cpu_attention_with_kv_cache(
            query=q.contiguous(),
            key_cache=key_cache,
            value_cache=value_cache,
            output=out,
            query_start_loc=starts,
            seq_lens=seq_lens,
            scale=impl.scale,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=block_table,
            softcap=0.0,
            scheduler_metadata=metadata,
            s_aux=None,
            **_cache_format(attn),
        )
        return out
