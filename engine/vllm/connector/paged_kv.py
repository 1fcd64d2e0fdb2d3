"""A `LinkedKV` over one request's paged KV blocks in vLLM's own cache tensors (vLLM worker).

The reused KV already sits in the request's blocks; at each layer the recomputed tokens' fresh K/V
are written into their slots, then their queries attend over the request's blocks with the exact
causal mask by prompt index. Slot of prompt index p: `block_ids[p // bs] * bs + p % bs`.

The cache layout's ops sit behind a small seam (`paged_ops.PagedKVOps`: clear, write slots, read
keys, attend), one implementation per layout, picked from the tensors vLLM registers
(`paged_ops` here): `paged_cpu.CpuPagedOps` (vLLM's CPU backend) and `paged_cuda.FlashPagedOps`
(the CUDA FlashAttention layout).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mpic.engine.vllm.connector.paged_cpu import CpuPagedOps
from mpic.engine.vllm.connector.paged_cuda import FlashPagedOps
from mpic.engine.vllm.connector.paged_ops import PagedKVOps
from mpic.kernels.attention import SelectiveAttention
from mpic.kernels.correction import Groups, attend_groups, prepare_corrected
from mpic.linker.correction import LinkCorrection


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
    (and `values`) [L, N, H_kv, D] are dense mirrors of the linked K/V, updated by every write,
    that reads use where the layout cannot be read (`PagedKVOps.readable` False: a CPU cache
    whose layout `paged_cpu.cpu_layout` could not learn); a readable layout needs none (the
    worker gives none there: `linking.RequestLinker._paged_kv`).
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
        self._grouped: tuple[torch.Tensor, torch.Tensor, int, Groups, Any, Any] | None = None
        """(index, linked, N, the two groups, where each group's rows lie) of the last query
        set whose groups are read straight from the blocks (`attend`)."""
        self._last_q: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        """layer -> (prompt index int64 [1], q [H, D], its linked group's log-sum-exp float32
        [H] where the attention gave it, else None) of the last query a corrected layer saw
        (tensors on the queries' device: no host read per layer)."""
        self._shifted: list[tuple[int, tuple]] = []
        """(layer, what `restore` writes back) of each layer `shift_for_last_query` moved:
        (place, the true key region) where the keys were shifted in place
        (`PagedKVOps.shift_keys`), else (cache slots, their true keys, their values)."""

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

    def corrects_at(self, layer: int) -> bool:
        """True when `attend` of `layer` runs the corrected attention (S != 1 there)."""
        corr = self._correction
        return corr is not None and corr.active and corr.scale_at(layer) != 1.0

    def set_correction(self, correction: LinkCorrection | None) -> None:
        """Apply the APE-style correction of linked keys in `attend` (None: plain). vLLM's CPU
        attention op returns no log-sum-exp, so corrected layers attend through
        `mpic.kernels.correction` (the reference runner's code) over the request's K/V: read
        from its blocks where the layout is readable (CPU through the learnt layout, CUDA
        directly), else from the dense mirrors (`keys` and `values`), which must then have been
        given. Exact against the dense linked KV (the same K/V values, the same code)."""
        if correction is not None and correction.active:
            readable = self._ops.readable and self._values is None
            if not readable and (self._keys is None or self._values is None):
                raise RuntimeError("the correction on an opaque paged layout needs K/V mirrors")
        self._correction = correction

    def _kv(self, layer: int, num_keys: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's keys and values of `layer` by prompt index, at least [0, num_keys)
        (None: all its blocks): the mirrors, else read from the blocks."""
        if self._values is not None and self._keys is not None:
            return self._keys[layer], self._values[layer]
        gathered = self._ops.gather(layer, num_keys)
        assert gathered is not None, "checked by set_correction"
        return gathered

    def attend(self, layer: int, q: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """q [S, H, D] at ascending prompt indices `index` -> [S, H, D], causal by index."""
        if not self.corrects_at(layer):
            return self._ops.attend(layer, q, index)
        corr = self._correction
        assert corr is not None
        # host indices (CPU): read only the blocks up to the last query; on a device, all of
        # them (reading the last index would wait for the device at every layer)
        num_keys = int(index[-1]) + 1 if index.device.type == "cpu" else None
        if num_keys is not None and not self.mirrored and self._ops.readable:
            grouped = self._attend_groups(layer, q, index, num_keys)
            if grouped is not None:
                return grouped
        keys, values = self._kv(layer, num_keys)
        index = index.to(keys.device)
        linked = corr.linked(layer, int(keys.shape[0]), keys.device)
        self._last_q[layer] = (index[-1:].detach(), q[-1].detach().clone(), None)
        return self._corrected(
            q, index, keys, values, self._scale(layer), linked=linked, s=corr.scale_at(layer)
        )

    def _attend_groups(
        self, layer: int, q: torch.Tensor, index: torch.Tensor, num_keys: int
    ) -> torch.Tensor | None:
        """The CPU corrected attention reading only its two groups' rows from the blocks
        (`mpic.kernels.correction.attend_groups`: the linked keys and the rest, each row read
        once, located once per query set); None where the kernel takes another path."""
        corr = self._correction
        assert corr is not None
        linked = corr.linked(layer, num_keys, index.device)
        held = self._grouped
        if held is None or held[0] is not index or held[1] is not linked or held[2] != num_keys:
            groups = prepare_corrected(index, linked, num_keys).groups
            if groups is None:  # no CPU flash kernel with log-sum-exps: the general path
                return None
            where_a = self._ops.locate(self.slots(groups.index_a))
            where_b = self._ops.locate(self.slots(groups.index_b))
            held = (index, linked, num_keys, groups, where_a, where_b)
            self._grouped = held
        _, _, _, groups, where_a, where_b = held
        group_a = self._ops.read_located(layer, where_a)
        group_b = self._ops.read_located(layer, where_b)
        scale = self._scale(layer)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        lse_a: list[torch.Tensor] = []
        out = attend_groups(q, group_a, group_b, corr.scale_at(layer), scale, groups, lse_a)
        self._last_q[layer] = (index[-1:].detach(), q[-1].detach().clone(), lse_a[0][:, -1])
        return out

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
        so decoding reads the true keys again. Returns the number of layers shifted.

        In bulk: the layers that share a linked set (one mask object per depth level,
        `LinkCorrection.linked`) locate their linked slots once, and the deltas of all of them
        are ONE batch of ops ([layers, H_kv, ...]), from the log-sum-exps the pass's corrected
        attention kept. Per layer, where the layout allows it (`PagedKVOps.shift_place`: the
        CPU layouts vLLM writes, the CUDA one), the keys alone are shifted in place: one read
        and one write of the key rows (whole blocks on the CPU), the values never touched;
        elsewhere (mirrors, a missing log-sum-exp) the linked keys and values are read and
        written. `restore` writes back what was read (nothing is read again)."""
        corr = self._correction
        if corr is None or not corr.active:
            return 0
        self._shifted = []
        seen = sorted(self._last_q.items())
        lasts = torch.cat([i.cpu() for _, (i, _, _) in seen]).tolist() if seen else []  # 1 read
        by_set: dict[int, tuple[torch.Tensor, list[tuple[int, torch.Tensor, Any]]]] = {}
        for (layer, (_, q, lse)), index in zip(seen, lasts, strict=True):
            if index == last_index:
                linked = corr.linked(layer, last_index + 1, q.device)
                by_set.setdefault(id(linked), (linked, []))[1].append((layer, q, lse))
        for linked, layers in by_set.values():
            slots = torch.nonzero(linked).flatten()
            if slots.numel() == 0:
                continue
            cache_slots = self.slots(slots)
            in_place = self._keys is None and all(lse is not None for _, _, lse in layers)
            place = self._ops.shift_place(cache_slots) if in_place else None
            if place is not None:
                deltas = self._deltas(layers)  # in place: no row is read
                for (layer, _, _), delta in zip(layers, deltas, strict=True):
                    saved = self._ops.shift_keys(layer, place, delta)
                    self._shifted.append((layer, (place, saved)))
                continue
            both = self._keys is not None and self._values is not None  # both mirrors
            where = None if both else self._ops.locate(cache_slots)
            true = [self._linked_rows(layer, slots, where) for layer, _, _ in layers]
            keys = torch.stack([k for k, _ in true])
            deltas = self._deltas(layers, keys)
            for (layer, _, _), (k, v), delta in zip(layers, true, deltas, strict=True):
                self._ops.write(layer, cache_slots, k + delta[None].to(k.dtype), v)
                self._shifted.append((layer, (cache_slots, k, v)))
        return len(self._shifted)

    def _linked_rows(
        self, layer: int, slots: torch.Tensor, where: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The linked keys and values [M, H_kv, D] at prompt indices `slots` of `layer`: from
        the mirrors, else read from the blocks at `where` (`PagedKVOps.locate`)."""
        if self._keys is not None and self._values is not None:
            at = slots.to(self._keys.device)
            return self._keys[layer, at], self._values[layer, at]
        return self._ops.read_located(layer, where)

    def _deltas(
        self, layers: list[tuple[int, torch.Tensor, Any]], keys: torch.Tensor | None = None
    ) -> torch.Tensor:
        """layers: (layer, its last query q [H, D], the linked group's log-sum-exp of q [H] or
        None) -> the key shift of each layer float64 [Ls, H_kv, D] (`shift_for_last_query`).
        The log-sum-exps the corrected attention gave are used as they are; missing ones are
        computed from keys [Ls, M, H_kv, D] (the linked keys; one batched matmul, float32);
        the least-norm solve runs in float64."""
        corr = self._correction
        assert corr is not None
        q = torch.stack([q for _, q, _ in layers])  # [Ls, H, D]
        count, dim = q.shape[0], q.shape[2]
        kv_heads = self._ops.num_kv_heads
        group = q.shape[1] // kv_heads
        per_layer = [
            (self._scale(layer) or dim**-0.5, corr.scale_at(layer)) for layer, _, _ in layers
        ]
        scale, s = torch.tensor(per_layer, dtype=torch.float64).to(q.device).unbind(-1)
        qf = q.float().view(count, kv_heads, group, dim)  # [Ls, H_kv, G, D]
        if all(lse is not None for _, _, lse in layers):
            lse = torch.stack([lse for _, _, lse in layers]).view(count, kv_heads, group)
        else:
            assert keys is not None, "a missing log-sum-exp is computed from the keys"
            scores = keys.float().transpose(1, 2) @ qf.transpose(-1, -2)  # [Ls, H_kv, M, G]
            lse = torch.logsumexp(scores * scale.float()[:, None, None, None], dim=2)
        bias = (s - 1.0)[:, None, None] * lse.double()  # c [Ls, H_kv, G]
        qd = qf.double()
        gram = qd @ qd.transpose(-1, -2)  # [Ls, H_kv, G, G]
        coef = torch.linalg.solve(gram, (bias / scale[:, None, None])[..., None])  # [.., G, 1]
        return (qd.transpose(-1, -2) @ coef)[..., 0]  # [Ls, H_kv, D]

    def restore(self) -> None:
        """Write the true linked keys back where `shift_for_last_query` moved them, from what
        it kept (nothing is read back)."""
        for layer, (place, *saved) in self._shifted:
            if len(saved) == 1:  # shifted in place
                self._ops.unshift_keys(layer, place, saved[0])
            else:
                self._ops.write(layer, place, *saved)
        self._shifted = []
