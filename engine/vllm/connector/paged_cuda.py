"""`PagedKVOps` for the CUDA FlashAttention layout (vLLM worker process). vLLM >= 0.32 registers a
per-layer cache of logical shape [num_blocks, H_kv, block_size, 2 * D] (any physical stride
order) that its backend views as `cache.transpose(1, 2).split(D, -1)` -> key/value [num_blocks,
block_size, H_kv, D]; older vLLM registers [2, num_blocks, block_size, H_kv, D] (key = [0],
value = [1]). Both give the same key/value views. Writes use vLLM's `reshape_and_cache_flash`
where the op exists (CUDA builds), else a torch index write (plain dtypes only). Attention
gathers the request's blocks through the block table into [B * block_size, H_kv, D] and runs
one `mpic.kernels.attention` backend call (`flex` on CUDA: one fused call per layer, block mask
built once per query set).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mpic.engine.vllm.connector.paged_ops import PagedKVOps
from mpic.kernels.attention import SelectiveAttention, default_backend_name


def flash_views(cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A FlashAttention-layout layer cache -> key, value views [num_blocks, block_size, H_kv, D].

    cache: [num_blocks, H_kv, block_size, 2 * D] (vLLM >= 0.32, any stride order) or
    [2, num_blocks, block_size, H_kv, D] (older vLLM). Views share the cache's storage."""
    if cache.dim() == 5:
        if cache.shape[0] != 2 or cache.shape[-1] != head_dim:
            raise ValueError(f"not a [2, B, bs, H_kv, {head_dim}] cache: {tuple(cache.shape)}")
        return cache[0], cache[1]
    if cache.dim() != 4 or cache.shape[-1] != 2 * head_dim:
        raise ValueError(f"not a [B, H_kv, bs, 2 * {head_dim}] cache: {tuple(cache.shape)}")
    key, value = cache.transpose(1, 2).split(head_dim, dim=-1)
    return key, value


class FlashPagedOps(PagedKVOps):
    """The CUDA FlashAttention layout (see the module docstring); runs on any device.

    layers: vLLM's `Attention` modules (scale, cache dtype, k/v scales), or None (then the
    softmax scale is D ** -0.5 and writes use torch); backend: attention backend name (default by
    device). `use_vllm_write`: None = vLLM's `reshape_and_cache_flash` on CUDA when it exists.
    """

    def __init__(
        self,
        caches: list[torch.Tensor],
        blocks: torch.Tensor,
        block_size: int,
        head_dim: int,
        layers: list[nn.Module] | None = None,
        backend: str | None = None,
        use_vllm_write: bool | None = None,
    ) -> None:
        self._views = [flash_views(c, head_dim) for c in caches]
        device = caches[0].device
        self._blocks = blocks.to(device)
        self._block_size = block_size
        self._layers = layers
        self._attention = SelectiveAttention(backend or default_backend_name(device))
        wanted = device.type == "cuda" if use_vllm_write is None else use_vllm_write
        self._vllm_write = _flash_write_op() if wanted else None
        if use_vllm_write and self._vllm_write is None:
            raise RuntimeError("vLLM's reshape_and_cache_flash is not available here")

    @property
    def num_kv_heads(self) -> int:
        """H_kv of the key views' [B, bs, H_kv, D] shape."""
        return int(self._views[0][0].shape[-2])

    def clear(self) -> None:
        """Zero the request's blocks of every layer's key and value views."""
        for key, value in self._views:
            key[self._blocks] = 0
            value[self._blocks] = 0

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """vLLM's `reshape_and_cache_flash`, else an index write into the views."""
        key, value = self._views[layer]
        slots = slots.to(key.device)
        if self._vllm_write is not None:
            attn = self._layers[layer] if self._layers is not None else None
            dtype = attn.impl.kv_cache_dtype if attn is not None else "auto"
            one = torch.ones((), dtype=torch.float32, device=key.device)
            k_scale = attn._k_scale if attn is not None else one
            v_scale = attn._v_scale if attn is not None else one
            self._vllm_write(
                k.contiguous(), v.contiguous(), key, value, slots, dtype, k_scale, v_scale
            )
            return
        if self._layers is not None and self._layers[layer].impl.kv_cache_dtype != "auto":
            raise NotImplementedError("quantised KV caches need vLLM's reshape_and_cache_flash")
        block, offset = slots // self._block_size, slots % self._block_size
        key[block, offset] = k.to(key.dtype)
        value[block, offset] = v.to(value.dtype)

    readable = True

    def read_keys(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The keys at `slots` straight from the cache."""
        key, _ = self._views[layer]
        slots = slots.to(key.device)
        return key[slots // self._block_size, slots % self._block_size]

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at `slots` straight from the cache."""
        key, value = self._views[layer]
        slots = slots.to(key.device)
        block, offset = slots // self._block_size, slots % self._block_size
        return key[block, offset], value[block, offset]

    def shift_place(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(block, offset in block) of cache slots `slots`, on the cache's device; None for a
        quantised cache (a shift there would not undo exactly)."""
        if self._layers is not None and self._layers[0].impl.kv_cache_dtype != "auto":
            return None
        slots = slots.to(self._blocks.device)
        return slots // self._block_size, slots % self._block_size

    def shift_keys(
        self, layer: int, place: tuple[torch.Tensor, torch.Tensor], delta: torch.Tensor
    ) -> torch.Tensor:
        """The keys at `place` read (one gather), written back shifted by delta [H_kv, D] (one
        scatter; the values are not touched); returns the true keys [M, H_kv, D]."""
        key, _ = self._views[layer]
        true = key[place]
        key[place] = true + delta.to(key.dtype)[None]
        return true

    def unshift_keys(
        self, layer: int, place: tuple[torch.Tensor, torch.Tensor], saved: torch.Tensor
    ) -> None:
        """The true keys back (a copy: bit-exact)."""
        self._views[layer][0][place] = saved

    def gather(self, layer: int, num_keys: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's blocks by the block table (those holding [0, num_keys) when given: a
        host int, no device read): keys, values [B' * bs, H_kv, D]."""
        key, value = self._views[layer]
        heads, dim = key.shape[-2], key.shape[-1]
        blocks = self._blocks
        if num_keys is not None:
            blocks = blocks[: -(-num_keys // self._block_size)]
        keys = key.index_select(0, blocks).reshape(-1, heads, dim)
        values = value.index_select(0, blocks).reshape(-1, heads, dim)
        return keys, values

    def scale(self, layer: int) -> float | None:
        """vLLM's softmax scale of the layer, when its modules were given."""
        return self._layers[layer].impl.scale if self._layers is not None else None

    def attend(self, layer: int, q: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Gather the request's blocks by the block table, then one backend call."""
        keys, values = self.gather(layer)
        return self._attention(q, index.to(keys.device), keys, values, self.scale(layer))


def _flash_write_op() -> Any:
    """vLLM's `reshape_and_cache_flash` where its CUDA op is registered, else None."""
    try:
        from vllm import _custom_ops as ops

        torch.ops._C_cache_ops.reshape_and_cache_flash  # noqa: B018 - raises if not registered
    except (ImportError, AttributeError, RuntimeError):
        return None
    return ops.reshape_and_cache_flash
