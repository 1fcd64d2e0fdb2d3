"""`PagedKVOps` for vLLM's CPU backend (vLLM worker process): per-layer cache [num_blocks, H_kv,
block_size, 2 * D] whose in-block layout depends on the ISA (docs/design.md "Platform notes"):
never indexed by hand. Writes go through `cpu_attn_reshape_and_cache`; ONE
`cpu_attention_with_kv_cache` call attends all recomputed runs, each run [a, b) a "virtual
sequence" of query length b - a and sequence length b sharing the request's block table (vLLM's
causal rule for a chunk is exactly "key index <= query index"; docs/design.md "Exact masks with
the engine's own attention op").
"""

from __future__ import annotations

import torch
from torch import nn

from mpic.engine.vllm.connector.paged_ops import PagedKVOps
from mpic.kernels.sdpa_runs import query_runs as contiguous_runs


def _cache_format(attn: nn.Module) -> dict:
    """The KV cache's dtype and quantisation scales, as vLLM's CPU ops take them."""
    return {
        "k_scale": attn._k_scale_float,
        "v_scale": attn._v_scale_float,
        "kv_cache_dtype": attn.impl.kv_cache_dtype,
    }


def split_cpu_cache(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_blocks, H_kv, block_size, 2*D] CPU cache -> its key and value regions, as vLLM's CPU
    kernel views them (K region then V region per block and head)."""
    num_blocks, num_kv_heads, block_size, _ = cache.shape
    both = cache.view(num_blocks, num_kv_heads, block_size * 2, -1)
    key_cache, value_cache = both.chunk(2, dim=2)
    return key_cache, value_cache


def cpu_attend_sequences(
    attn: nn.Module,
    cache: torch.Tensor,
    q: torch.Tensor,
    starts: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
) -> torch.Tensor:
    """One `cpu_attention_with_kv_cache` call over virtual sequences: query rows
    starts[i]:starts[i+1] of q [S, H, D] attend causally to the first seq_lens[i] slots of
    block_table[i] (int32 [R+1], [R], [R, blocks]) in one layer's paged cache -> [S, H, D]."""
    from vllm import _custom_ops as ops
    from vllm import envs

    impl = attn.impl
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(seq_lens),
        num_heads=q.shape[1],
        num_kv_heads=impl.num_kv_heads,
        head_dim=q.shape[2],
        seq_lens=seq_lens,
        dtype=q.dtype,
        query_start_loc=starts,
        causal=True,
        sliding_window_size=-1,
        isa=attn.isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        kv_cache_dtype=impl.kv_cache_dtype,
    )
    key_cache, value_cache = split_cpu_cache(cache)
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


class CpuPagedOps(PagedKVOps):
    """vLLM's CPU attention backend (its own ops for every access; see the module docstring)."""

    def __init__(
        self,
        layers: list[nn.Module],
        caches: list[torch.Tensor],
        blocks: torch.Tensor,
        block_size: int,
    ) -> None:
        self._layers = layers
        self._caches = caches
        self._blocks = blocks
        self._block_table = blocks.to(torch.int32).unsqueeze(0)
        self._block_size = block_size

    def clear(self) -> None:
        """Zero is zero in any in-block layout."""
        for cache in self._caches:
            cache[self._blocks] = 0

    def _split(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return split_cpu_cache(self._caches[layer])

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """`cpu_attn_reshape_and_cache`: the portable write for every ISA layout."""
        from vllm import _custom_ops as ops

        attn = self._layers[layer]
        key_cache, value_cache = self._split(layer)
        ops.cpu_attn_reshape_and_cache(
            k.contiguous(),
            v.contiguous(),
            key_cache,
            value_cache,
            slots,
            attn.isa,
            **_cache_format(attn),
        )

    def attend(self, layer: int, q: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """One `cpu_attention_with_kv_cache` call, one virtual sequence per run."""
        runs = contiguous_runs(index)
        host = index.cpu()
        starts = torch.tensor([0] + [b for _, b in runs], dtype=torch.int32)
        seq_lens = torch.tensor([int(host[b - 1]) + 1 for _, b in runs], dtype=torch.int32)
        block_table = self._block_table.expand(len(runs), -1).contiguous()
        return cpu_attend_sequences(
            self._layers[layer], self._caches[layer], q, starts, seq_lens, block_table
        )
