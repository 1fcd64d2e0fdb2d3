"""A `LinkedKV` over one request's paged KV blocks in vLLM's own cache tensors (vLLM worker).

The reused KV already sits in the request's blocks; at each layer the recomputed tokens' fresh K/V
are written into their slots, then their queries attend over the request's blocks with the exact
causal mask by prompt index. Slot of prompt index p: `block_ids[p // bs] * bs + p % bs`.

A small ops seam (`PagedKVOps`: clear, write slots, read keys, attend) has one implementation per
cache layout, picked from the tensors vLLM registers (`paged_ops`):

- `CpuPagedOps`: vLLM's CPU backend, per-layer cache [num_blocks, H_kv, block_size, 2 * D] whose
  in-block layout depends on the ISA (docs/design.md "Platform notes"): never indexed by hand.
  Writes go through `cpu_attn_reshape_and_cache`; ONE `cpu_attention_with_kv_cache` call attends
  all recomputed runs, each run [a, b) a "virtual sequence" of query length b - a and sequence
  length b sharing the request's block table (vLLM's causal rule for a chunk is exactly "key
  index <= query index"; docs/design.md "Exact masks with the engine's own attention op").
- `FlashPagedOps`: the CUDA FlashAttention layout. vLLM >= 0.32 registers a per-layer cache of
  logical shape [num_blocks, H_kv, block_size, 2 * D] (any physical stride order) that its
  backend views as `cache.transpose(1, 2).split(D, -1)` -> key/value [num_blocks, block_size,
  H_kv, D]; older vLLM registers [2, num_blocks, block_size, H_kv, D] (key = [0], value = [1]).
  Both give the same key/value views. Writes use vLLM's `reshape_and_cache_flash` where the op
  exists (CUDA builds), else a torch index write (plain dtypes only). Attention gathers the
  request's blocks through the block table into [B * block_size, H_kv, D] and runs one
  `mpic.kernels.attention` backend call (`flex` on CUDA: one fused call per layer, block mask
  built once per query set).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

from mpic.kernels.attention import SelectiveAttention, default_backend_name
from mpic.kernels.sdpa_runs import query_runs as contiguous_runs
from mpic.linker.correction import LinkCorrection


class PagedKVOps(ABC):
    """Writes and attention over one request's blocks in one cache layout (all layers)."""

    readable: bool = False
    """True when `read_keys` reads the cache itself (no dense key mirror needed)."""

    @abstractmethod
    def clear(self) -> None:
        """Zero the request's blocks in every layer (the "dummy cache")."""

    @abstractmethod
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [S, H_kv, D] at cache slots int64 [S] of `layer`."""

    def read_keys(self, layer: int, slots: torch.Tensor) -> torch.Tensor | None:
        """Keys at `slots` of `layer` [S, H_kv, D], or None where the layout is opaque."""
        return None

    def gather(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The request's keys and values of `layer` by prompt index ([B * bs, H_kv, D] each), or
        None where the layout is opaque (CPU: the linked-key correction then reads mirrors)."""
        return None

    def scale(self, layer: int) -> float | None:
        """The layer's softmax scale (None: D ** -0.5)."""
        return None

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """q [S, H, D] at ascending prompt indices `index` -> [S, H, D], causal by index."""


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

    def gather(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's blocks by the block table: keys, values [B * bs, H_kv, D]."""
        key, value = self._views[layer]
        heads, dim = key.shape[-2], key.shape[-1]
        keys = key.index_select(0, self._blocks).reshape(-1, heads, dim)
        values = value.index_select(0, self._blocks).reshape(-1, heads, dim)
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


def paged_ops(
    layers: list[nn.Module], caches: list[torch.Tensor], blocks: torch.Tensor, block_size: int
) -> PagedKVOps:
    """The ops for the caches vLLM registered: CPU tensors -> `CpuPagedOps`; CUDA tensors ->
    `FlashPagedOps` (the FlashAttention layout, the default CUDA backend)."""
    if caches[0].device.type == "cpu":
        return CpuPagedOps(layers, caches, blocks, block_size)
    head_dim = int(layers[0].impl.head_size)
    return FlashPagedOps(caches, blocks, block_size, head_dim, layers=layers)


class PagedLinkedKV:
    """Linked KV of one prompt living in vLLM's paged cache (one tensor per attention layer).

    `layers[l]` is vLLM's `Attention` module of decoder layer l, `caches[l]` its KV tensor,
    `block_ids` the request's blocks in order; `ops` overrides the layout's ops (tests). `keys`
    [L, N, H_kv, D] is a dense mirror of the linked keys, updated by every write, that
    `read_keys` uses where the layout cannot be read directly (CPU); ignored otherwise.
    """

    def __init__(
        self,
        layers: list[nn.Module],
        caches: list[torch.Tensor],
        block_ids: list[int],
        block_size: int,
        keys: torch.Tensor | None = None,
        ops: PagedKVOps | None = None,
        values: torch.Tensor | None = None,
    ) -> None:
        self._block_size = block_size
        self._blocks = torch.tensor(block_ids, dtype=torch.int64, device=caches[0].device)
        self._ops = ops or paged_ops(layers, caches, self._blocks, block_size)
        self._keys = None if self._ops.readable and values is None else keys
        self._values = values
        """Dense value mirror [L, N, H_kv, D] (with `keys`): the corrected attention's input
        where the layout is opaque (CPU)."""
        self._layers = layers
        self._num_layers = len(caches)
        self._correction: LinkCorrection | None = None
        self._corrected = SelectiveAttention("sdpa_runs")  # mpic.kernels.correction
        self._last_q: dict[int, tuple[int, torch.Tensor]] = {}
        """layer -> (prompt index, q [H, D]) of the last query a corrected layer saw."""
        self._shifted: list[tuple[int, torch.Tensor]] = []
        """(layer, slots) whose keys `shift_for_last_query` moved (undone by `restore`)."""

    @property
    def mirrored(self) -> bool:
        """True when writes also go to dense mirrors (the correction or a hook reads them)."""
        return self._keys is not None or self._values is not None

    def slots(self, index: torch.Tensor) -> torch.Tensor:
        """Prompt indices int64 [S] -> cache slots int64 [S] (on the caches' device)."""
        bs = self._block_size
        index = index.to(self._blocks.device)
        return self._blocks[index // bs] * bs + index % bs

    def clear(self) -> None:
        """Zero the request's blocks in every layer."""
        self._ops.clear()

    def write(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite prompt slots `index` [S] of `layer` with k, v [S, H_kv, D]."""
        self._ops.write(layer, self.slots(index), k, v)
        if self._keys is not None:
            self._keys[layer, index.to(self._keys.device)] = k.to(self._keys)
        if self._values is not None:
            self._values[layer, index.to(self._values.device)] = v.to(self._values)

    def write_layers(self, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite prompt slots `index` [S] of every layer with k, v [L, S, H_kv, D] (one
        write per layer: vLLM keeps one cache tensor per layer)."""
        slots = self.slots(index)
        for layer in range(self._num_layers):
            self._ops.write(layer, slots, k[layer], v[layer])
        if self._keys is not None:
            self._keys[:, index.to(self._keys.device)] = k.to(self._keys)
        if self._values is not None:
            self._values[:, index.to(self._values.device)] = v.to(self._values)

    def read_keys(self, layer: int, index: torch.Tensor) -> torch.Tensor:
        """The linked keys at `index` of `layer`: [S, H_kv, D]."""
        keys = self._ops.read_keys(layer, self.slots(index))
        if keys is not None:
            return keys
        if self._keys is None:
            raise RuntimeError("PagedLinkedKV built without a key mirror cannot read keys")
        return self._keys[layer, index.to(self._keys.device)]

    def set_correction(self, correction: LinkCorrection | None) -> None:
        """Apply the APE-style correction of linked keys in `attend` (None: plain). vLLM's CPU
        attention op returns no log-sum-exp, so corrected layers attend through
        `mpic.kernels.correction` (the reference runner's code) over the request's K/V: gathered
        from the blocks where the layout is readable, else from the dense mirrors (`keys` and
        `values`), which must then have been given. Exact against the dense linked KV (same f32
        inputs, same code)."""
        if correction is not None and correction.active:
            readable = self._ops.readable and self._values is None
            if not readable and (self._keys is None or self._values is None):
                raise RuntimeError("the correction on an opaque paged layout needs K/V mirrors")
        self._correction = correction

    def attend(self, layer: int, q: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """q [S, H, D] at ascending prompt indices `index` -> [S, H, D], causal by index."""
        corr = self._correction
        if corr is None or not corr.active or corr.scale_at(layer) == 1.0:
            return self._ops.attend(layer, q, index)
        if self._values is not None and self._keys is not None:
            keys, values = self._keys[layer], self._values[layer]
        else:
            gathered = self._ops.gather(layer)
            assert gathered is not None, "checked by set_correction"
            keys, values = gathered
        index = index.to(keys.device)
        linked = corr.linked(layer, int(keys.shape[0]), keys.device)
        self._last_q[layer] = (int(index[-1]), q[-1].detach().clone())
        return self._corrected(
            q, index, keys, values, self._scale(layer), linked=linked, s=corr.scale_at(layer)
        )

    def _scale(self, layer: int) -> float | None:
        scale = self._ops.scale(layer)
        if scale is None and self._layers:
            scale = self._layers[layer].impl.scale
        return scale

    def shift_for_last_query(self, last_index: int) -> int:
        """Make vLLM's own (plain) attention of the prompt's last token equal the corrected one.

        vLLM's forward recomputes token N-1 over the blocks with plain attention. For one query
        the correction is a per-head constant bias c_h = (S - 1) * lse_A,h on the linked scores
        (`mpic.kernels.correction`), which a shift of the linked keys can carry: per layer and
        KV head g, delta_g = Q_g^T (Q_g Q_g^T)^-1 c_g / scale (least norm), Q_g [G, D] the
        last query's heads sharing g, so that scale * q_h . (k_j + delta_g) = scale * q_h . k_j
        + c_h for every linked key j and every h of the group. The shifted keys are written
        into the cache only (mirrors keep the linked keys); call `restore` after vLLM's forward
        so decoding reads the true keys again. Returns the number of layers shifted."""
        corr = self._correction
        if corr is None or not corr.active:
            return 0
        self._shifted = []
        for layer, (index, q) in sorted(self._last_q.items()):
            if index != last_index:
                continue
            if self._values is not None and self._keys is not None:
                keys, values = self._keys[layer], self._values[layer]
            else:
                gathered = self._ops.gather(layer)
                assert gathered is not None
                keys, values = gathered
            n = index + 1
            linked = corr.linked(layer, n, keys.device)
            slots = torch.nonzero(linked).flatten()
            if slots.numel() == 0:
                continue
            heads, dim = q.shape
            kv_heads = keys.shape[1]
            group = heads // kv_heads
            scale = self._scale(layer) or dim**-0.5
            k_linked = keys[slots].double()  # [M, H_kv, D]
            qd = q.double().view(kv_heads, group, dim)  # [H_kv, G, D]
            scores = torch.einsum("mgd,gjd->gjm", k_linked, qd) * scale  # [H_kv, G, M]
            bias = (corr.scale_at(layer) - 1.0) * torch.logsumexp(scores, dim=-1)  # [H_kv, G]
            gram = qd @ qd.transpose(1, 2)  # [H_kv, G, G]
            coef = torch.linalg.solve(gram, bias[..., None] / scale)  # [H_kv, G, 1]
            delta = (qd.transpose(1, 2) @ coef)[..., 0]  # [H_kv, D]
            shifted = (k_linked + delta[None]).to(keys.dtype)
            self._ops.write(layer, self.slots(slots), shifted, values[slots])
            self._shifted.append((layer, slots))
        return len(self._shifted)

    def restore(self) -> None:
        """Write the true linked keys back where `shift_for_last_query` moved them."""
        for layer, slots in self._shifted:
            if self._values is not None and self._keys is not None:
                keys, values = self._keys[layer], self._values[layer]
            else:
                raise RuntimeError("restoring shifted keys needs the K/V mirrors")
            self._ops.write(layer, self.slots(slots), keys[slots], values[slots])
        self._shifted = []
