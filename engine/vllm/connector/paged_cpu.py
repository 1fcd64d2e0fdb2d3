"""`PagedKVOps` for vLLM's CPU backend (vLLM worker process): per-layer cache [num_blocks, H_kv,
block_size, 2 * D] whose in-block layout depends on the ISA (docs/design.md "Platform notes"):
never indexed by an assumed layout. Writes go through `cpu_attn_reshape_and_cache`; ONE
`cpu_attention_with_kv_cache` call attends all recomputed runs, each run [a, b) a "virtual
sequence" of query length b - a and sequence length b sharing the request's block table (vLLM's
causal rule for a chunk is exactly "key index <= query index"; docs/design.md "Exact masks with
the engine's own attention op").

Reads (the linked-key correction's two groups, CacheBlend's keys, the shifted keys' restore) go
through the in-block layout LEARNT from vLLM's own write op (`cpu_layout`): a one-block scratch
cache is written once per (ISA, dtype, heads, block size, head size) with values that encode each
element's (token, head, dim) coordinate, and the positions they land at give a gather index. The
layout is then read, never assumed; a write that is not a pure permutation (a quantised cache)
leaves the layout opaque (`readable` False: the caller keeps dense mirrors). Where a region's
learnt layout is a plain one (`vec` / `vec16`: keys [D, bs] per head and block, values
[bs, D]) a read is a strided gather by (block, offset); otherwise one `index_select` of flat
element offsets (`amx` bf16 keeps pairs of elements together)."""

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


_LAYOUTS: dict[tuple, tuple[torch.Tensor, torch.Tensor] | None] = {}
"""(isa, dtype, H_kv, block_size, D) -> the layout `cpu_layout` learnt (None: not a permutation)."""


def cpu_layout(
    isa: str, dtype: torch.dtype, kv_heads: int, block_size: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where vLLM's CPU write op puts each element of a block: (key_at, value_at), int64 [bs,
    H_kv * D] each: element (token t, head h, dim d) of a block's key region (flattened
    [H_kv, bs, D] view of `split_cpu_cache`) sits at key_at[t, h * D + d]. Learnt once per
    layout by writing coordinates through `cpu_attn_reshape_and_cache` into a scratch block
    (base-256 digits: exact in bf16 too); None if the write is not a permutation."""
    key = (isa, dtype, kv_heads, block_size, head_dim)
    if key in _LAYOUTS:
        return _LAYOUTS[key]
    from vllm import _custom_ops as ops

    n = block_size * kv_heads * head_dim
    ids = torch.arange(n, dtype=torch.int64)
    found = [torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)]
    digits = 1
    while 256**digits < n:
        digits += 1
    slots = torch.arange(block_size, dtype=torch.int64)
    for digit in range(digits):
        cache = torch.zeros(1, kv_heads, block_size, 2 * head_dim, dtype=dtype)
        key_cache, value_cache = split_cpu_cache(cache)
        code = ((ids // 256**digit) % 256).to(dtype).view(block_size, kv_heads, head_dim)
        try:
            ops.cpu_attn_reshape_and_cache(
                code, code.clone(), key_cache, value_cache, slots, isa, 1.0, 1.0, "auto"
            )
        except RuntimeError:  # a configuration the op refuses: nothing to learn
            _LAYOUTS[key] = None
            return None
        for held, region in zip(found, (key_cache, value_cache), strict=True):
            held += region[0].reshape(-1).to(torch.int64) * 256**digit
    layout: tuple[torch.Tensor, torch.Tensor] | None = None
    if all(torch.equal(torch.sort(held).values, ids) for held in found):
        at = []
        for held in found:
            where = torch.empty(n, dtype=torch.int64)
            where[held] = torch.arange(n, dtype=torch.int64)  # element id -> storage position
            at.append(where.view(block_size, kv_heads * head_dim))
        layout = (at[0], at[1])
    _LAYOUTS[key] = layout
    return layout


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
        self._learnt: tuple[tuple[torch.Tensor, torch.Tensor] | None] | None = None
        self._shape: tuple[str | None, str | None] | None = None
        """Per region, the learnt layout's plain shape (`_shapes`)."""
        self._within: tuple[torch.Tensor, torch.Tensor, int] | None = None
        """(key and value offsets within a block [bs, H_kv * D], elements per block)."""
        self._gathers: dict[int, tuple] = {}
        """num_keys -> where `gather` reads (`locate`)."""

    @property
    def _layout(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The caches' in-block layout (`cpu_layout`), learnt on first use; None if opaque
        (a quantised cache, a configuration vLLM's write op refuses)."""
        if self._learnt is None:
            layout = None
            attn, cache = self._layers[0], self._caches[0]
            if attn.impl.kv_cache_dtype == "auto":
                heads, block, width = cache.shape[1], cache.shape[2], cache.shape[3]
                layout = cpu_layout(attn.isa, cache.dtype, heads, block, width // 2)
            self._learnt = (layout,)
        return self._learnt[0]

    @property
    def num_kv_heads(self) -> int:
        """H_kv of the caches' [B, H_kv, bs, 2 D] shape."""
        return int(self._caches[0].shape[1])

    @property
    def readable(self) -> bool:  # type: ignore[override]
        """True when the in-block layout was learnt (`cpu_layout`): reads need no mirror."""
        return self._layout is not None

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

    def _offsets(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the keys and the values of cache slots int64 [S] lie in a layer's cache (flat
        element offsets [S, H_kv * D] each, the same for every layer: the caches share one
        shape; int32 where the cache has fewer than 2^31 elements). Key (block b, head h,
        in-block element e of `cpu_layout`) sits at b * H_kv * 2 * bs * D + h * 2 * bs * D + e
        (the K region then the V region per block and head)."""
        if self._within is None:
            layout = self._layout
            assert layout is not None, "an opaque layout cannot be read"
            _, heads, bs, width = self._caches[0].shape
            region = bs * (width // 2)  # one head's K (or V) region of a block
            small = self._caches[0].numel() < 2**31  # int32: half the memory, faster reads
            dtype = torch.int32 if small else torch.int64
            within = [  # skip the other region of each head
                (at + at // region * region + shift).to(dtype)
                for shift, at in ((0, layout[0]), (region, layout[1]))
            ]
            self._within = (within[0], within[1], heads * 2 * region)
        at_k, at_v, per_block = self._within
        bs = self._block_size
        base = (slots // bs * per_block).to(at_k.dtype)[:, None]
        offset = slots % bs
        return base + at_k[offset], base + at_v[offset]

    def _read(self, layer: int, offsets: torch.Tensor) -> torch.Tensor:
        """Cache elements at flat `offsets` [S, H_kv * D] -> [S, H_kv, D] (one gather)."""
        cache = self._caches[layer]
        if cache.is_contiguous():  # ~30x faster than `torch.take` on the host
            rows = cache.view(-1).index_select(0, offsets.reshape(-1))
        else:
            rows = torch.take(cache, offsets.long())
        return rows.view(offsets.shape[0], cache.shape[1], -1)

    def read_keys(self, layer: int, slots: torch.Tensor) -> torch.Tensor | None:
        """The keys at `slots` through the learnt layout (None when it is opaque)."""
        if self._layout is None:
            return None
        return self.read(layer, slots)[0]

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at `slots` [S, H_kv, D] each (a readable layout only)."""
        return self.read_located(layer, self.locate(slots))

    def _shapes(self) -> tuple[str | None, str | None]:
        """Per region (keys, values), the learnt layout when it is a plain one: "rows" (each
        head's block [bs, D], token-major) or "columns" ([D, bs], the keys of the `vec` ISAs);
        None for another permutation (then flat offsets)."""
        if self._shape is None:
            layout = self._layout
            assert layout is not None, "an opaque layout cannot be read"
            _, heads, bs, width = self._caches[0].shape
            dim = width // 2
            t = torch.arange(bs)[:, None, None]
            h = torch.arange(heads)[None, :, None]
            d = torch.arange(dim)[None, None, :]
            rows = (h * bs * dim + t * dim + d).reshape(bs, -1)
            columns = (h * bs * dim + d * bs + t).reshape(bs, -1)
            found: list[str | None] = []
            for at in layout:
                kind = None
                if torch.equal(at, rows):
                    kind = "rows"
                elif torch.equal(at, columns):
                    kind = "columns"
                found.append(kind)
            self._shape = (found[0], found[1])
        return self._shape

    def _view(self, layer: int, region: int, kind: str) -> torch.Tensor:
        """One region of a contiguous layer cache as [num_blocks, H_kv, bs, D] ("rows") or
        [num_blocks, H_kv, D, bs] ("columns"), a strided view of its storage."""
        cache = self._caches[layer]
        blocks, heads, bs, width = cache.shape
        dim = width // 2
        size = (blocks, heads, bs, dim) if kind == "rows" else (blocks, heads, dim, bs)
        inner = (dim, 1) if kind == "rows" else (bs, 1)
        stride = (heads * 2 * bs * dim, 2 * bs * dim, *inner)
        return cache.as_strided(size, stride, cache.storage_offset() + region * bs * dim)

    def locate(self, slots: torch.Tensor) -> tuple:
        """Where the keys and values at `slots` lie: (block, offset in block) where both
        regions have a plain layout (`_shapes`) and the caches are contiguous, else the flat
        offsets of `_offsets`."""
        kinds = self._shapes()
        if None not in kinds and all(c.is_contiguous() for c in self._caches):
            return ("blocks", slots // self._block_size, slots % self._block_size)
        return ("flat", *self._offsets(slots))

    def read_located(self, layer: int, where: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at slots located by `locate`: one gather each."""
        if where[0] == "flat":
            return self._read(layer, where[1]), self._read(layer, where[2])
        _, block, offset = where
        out = []
        for region, kind in enumerate(self._shapes()):
            view = self._view(layer, region, kind)
            out.append(view[block, :, offset] if kind == "rows" else view[block, :, :, offset])
        return out[0], out[1]

    def shift_place(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the blocks holding `slots` int64 [T], bool [T, bs]: the slots within them) where
        the key region has a plain layout (`_shapes`) and the caches are contiguous; else
        None."""
        if self._layout is None:
            return None
        where = self.locate(slots)
        if where[0] != "blocks":
            return None
        _, block, offset = where
        touched, row = torch.unique(block, return_inverse=True)
        within = torch.zeros(int(touched.numel()), self._block_size, dtype=torch.bool)
        within[row, offset] = True
        return touched, within

    def shift_keys(
        self, layer: int, place: tuple[torch.Tensor, torch.Tensor], delta: torch.Tensor
    ) -> torch.Tensor:
        """The key region of the touched blocks read whole (one gather of whole blocks), the
        delta added at the slots within them, written back whole (one scatter); returns the
        true region [T, H_kv, ...] (`unshift_keys`)."""
        touched, within = place
        kind = self._shapes()[0]
        view = self._view(layer, 0, kind)  # [B, H_kv, bs, D] rows, [B, H_kv, D, bs] columns
        true = view[touched]
        step = delta.to(view.dtype)
        if kind == "rows":
            shifted = torch.where(within[:, None, :, None], true + step[None, :, None], true)
        else:
            shifted = torch.where(within[:, None, None, :], true + step[None, :, :, None], true)
        view[touched] = shifted
        return true

    def unshift_keys(
        self, layer: int, place: tuple[torch.Tensor, torch.Tensor], saved: torch.Tensor
    ) -> None:
        """The true key region back (a copy: bit-exact)."""
        self._view(layer, 0, self._shapes()[0])[place[0]] = saved

    def gather(
        self, layer: int, num_keys: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The request's keys and values of `layer` at prompt indices [0, num_keys) (None: all
        its blocks) -> [num_keys, H_kv, D] each, one gather each; None if opaque. The offsets
        are kept per `num_keys` (a pass asks for the same few at every layer)."""
        if self._layout is None:
            return None
        bs = self._block_size
        n = int(self._blocks.numel()) * bs if num_keys is None else num_keys
        if n not in self._gathers:
            p = torch.arange(n, dtype=torch.int64)
            self._gathers[n] = self.locate(self._blocks[p // bs] * bs + p % bs)
        return self.read_located(layer, self._gathers[n])

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
