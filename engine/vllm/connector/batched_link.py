"""Batched linking: the linked requests of one step in ONE link pass (vLLM worker).

MPIC's selective prefill (docs/design.md "Selective prefill") runs a prompt's recomputed tokens
layer by layer over its linked KV. Done per request, a step that links 8 requests runs 8 passes
of L layers of small matmuls. `link_batch` hands them to the linker's one link pass
(`mpic.linker.pipeline.link_pass`, the reference runner's too, as its batch of one): each
request's entries and cached prefix linked, ONE scouting pass for all the scouting requests
(the default `auto`), each request's correction set, then ONE selective pass in which the
requests' recomputed tokens are concatenated into one virtual prompt (request r's prompt index
p becomes g = offset_r + p), so each layer's norms, projections and MLP run once over all of
them. `BatchedPagedKV` routes the two cache operations per layer:

- write: one `cpu_attn_reshape_and_cache` with every token's own slot
  (`block_ids_r[p // bs] * bs + p % bs`);
- attend: ONE `cpu_attention_with_kv_cache` call per layer; every contiguous run of a request's
  queries is a virtual sequence with that request's block table and sequence length p_end + 1,
  so each query sees exactly its own request's keys up to its own prompt index (a per-request
  causal mask over its own blocks, the exact mask of the one-request pass).

A request of the batch that carries the linked-key correction attends through its own
`PagedLinkedKV` at its corrected layers (`PagedLinkedKV.corrects_at`: the corrected kernel over
its K/V read from its blocks, one call per request and layer), the other requests' rows still
in the one `cpu_attention_with_kv_cache` call; writes stay one call. On other devices (CUDA),
and where a request keeps dense mirrors (a CPU layout that could not be learnt), the two
operations loop over the requests' `PagedLinkedKV`s (one call each:
`mpic.linker.kv.stacked.StackedLinkedKV`); the layer compute is still shared. Every policy
joins: two-step ones (full reuse, CacheBlend) have their text-first passes run as one pass of
the batch's two-step requests (`mpic.linker.two_step`), each text alone in view, and an in-pass
hook (CacheBlend's KV-deviation check) selects among its own request's rows
(`mpic.linker.pipeline`). Compression requests link in a pass of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mpic.engine.vllm.connector.paged_cpu import CpuPagedOps, cpu_attend_sequences
from mpic.engine.vllm.connector.paged_kv import PagedLinkedKV
from mpic.linker.contracts import LayerAdapter
from mpic.linker.kv.stacked import StackedLinkedKV
from mpic.linker.pipeline import LinkedPrefill, link_pass
from mpic.linker.policies import Policy
from mpic.linker.prefix import CachedPrefix
from mpic.linker.recipe import PlannedPrompt
from mpic.types import CacheEntry, LinkPlan


@dataclass
class BatchItem:
    """One request of a batch: its plan (the front end's depths), entries, policy and paged
    KV (its correction, when the policy corrects, set by the pass:
    `PagedLinkedKV.set_correction`)."""

    plan: LinkPlan
    entries: Sequence[CacheEntry]
    kv: PagedLinkedKV
    block_ids: list[int]
    policy: Policy
    prefix: CachedPrefix | None = None
    """The template/system prefix linked exactly (`mpic.linker.prefix`: the link pass writes
    it and gives its tokens depth 0), or None."""


class BatchedPagedKV(StackedLinkedKV):
    """`LinkedKV` over several requests' paged blocks (see the module docstring).

    items: the requests in batch order (offsets[r]: first global index of request r); layers,
    caches: vLLM's per-layer Attention modules and KV tensors; block_size: vLLM's."""

    def __init__(
        self,
        items: Sequence[BatchItem],
        layers: list[nn.Module],
        caches: list[torch.Tensor],
        block_size: int,
    ) -> None:
        self._items = list(items)
        super().__init__([it.kv for it in self._items], [it.plan.num_tokens for it in items])
        self._layers, self._caches, self._bs = layers, caches, block_size
        slots = []
        for it in self._items:
            blocks = torch.tensor(it.block_ids, dtype=torch.int64)
            p = torch.arange(it.plan.num_tokens)
            slots.append(blocks[p // block_size] * block_size + p % block_size)
        device = caches[0].device
        self._slots = torch.cat(slots).to(device)
        # one CPU op call per layer for all requests, unless a request keeps dense mirrors
        # (an opaque layout): then, as on CUDA, each request's KV serves its rows
        self._cpu = device.type == "cpu" and not any(it.kv.mirrored for it in self._items)
        self._plain: tuple[torch.Tensor, frozenset[int], list, torch.Tensor] | None = None
        """(index, corrected requests, their pieces, the other rows) of the last split."""
        if self._cpu:
            width = max(len(it.block_ids) for it in self._items)
            table = torch.zeros(len(self._items), width, dtype=torch.int32)
            for r, it in enumerate(self._items):
                table[r, : len(it.block_ids)] = torch.tensor(it.block_ids, dtype=torch.int32)
            self._tables = table
            unused = torch.zeros(1, dtype=torch.int64)  # writes take slots, not blocks
            self._writer = CpuPagedOps(layers, caches, unused, block_size)

    def _pieces(self, index: torch.Tensor) -> list[tuple[int, int, int]]:
        """Rows [a, b) of `index` (ascending global indices) that are contiguous and in one
        request r: [(a, b, r)]."""
        return self._ranges(index, contiguous=True)

    def write(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite global indices `index` [S] of `layer` with k, v [S, H_kv, D]."""
        if self._cpu:
            self._writer.write(layer, self._slots[index.to(self._slots.device)], k, v)
            return
        super().write(layer, index, k, v)

    def attend(self, layer: int, q: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """q [S, H, D] at ascending global indices -> [S, H, D], each row over its own
        request's keys [0, p]."""
        if not self._cpu:  # one call per request over all its rows
            return super().attend(layer, q, index)
        corrected = frozenset(
            r for r, kv in enumerate(self._kvs) if getattr(kv, "corrects_at", _never)(layer)
        )
        if not corrected:
            return self._attend_plain(layer, q, index, self._pieces(index))
        held = self._plain
        if held is None or held[0] is not index or held[1] != corrected:
            pieces = [p for p in self._pieces(index) if p[2] not in corrected]
            rows = [torch.arange(a, b) for a, b, _ in pieces]
            picked = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
            held = (index, corrected, pieces, picked)
            self._plain = held
        _, _, pieces, rows = held
        out = torch.empty_like(q)
        if pieces:  # the plain requests' rows: one call, their pieces renumbered
            starts, kept = 0, []
            for a, b, r in pieces:
                kept.append((starts, starts + b - a, r))
                starts += b - a
            out[rows] = self._attend_plain(layer, q[rows], index[rows], kept)
        for a, b, r, local in self.by_request(index):
            if r in corrected:  # the corrected kernel over the request's own blocks
                out[a:b] = self._kvs[r].attend(layer, q[a:b], local)
        return out

    def _attend_plain(
        self,
        layer: int,
        q: torch.Tensor,
        index: torch.Tensor,
        pieces: list[tuple[int, int, int]],
    ) -> torch.Tensor:
        """ONE `cpu_attention_with_kv_cache` call: each piece (rows [a, b) of q, request r) a
        virtual sequence over request r's block table."""
        host = index.cpu()
        starts = torch.tensor([0] + [b for _, b, _ in pieces], dtype=torch.int32)
        seq_lens = torch.tensor(
            [int(host[b - 1]) - int(self.offsets[r]) + 1 for _, b, r in pieces], dtype=torch.int32
        )
        block_table = self._tables[[r for _, _, r in pieces]].contiguous()
        return cpu_attend_sequences(
            self._layers[layer], self._caches[layer], q, starts, seq_lens, block_table
        )


def _never(layer: int) -> bool:
    """`corrects_at` of a linked KV that has no correction."""
    return False


def link_batch(
    adapter: LayerAdapter,
    items: Sequence[BatchItem],
    layers: list[nn.Module],
    caches: list[torch.Tensor],
    block_size: int,
) -> list[LinkedPrefill]:
    """Link every request of `items` in one link pass (`link_pass` over a `BatchedPagedKV`):
    each request's blocks zeroed, then linked, scouted, prefilled with the others. Returns each
    request's outcome (its plan with its final depths, its scout's report). No logits (vLLM's
    forward computes the last token)."""
    for it in items:
        it.kv.clear()
    prompts = [
        PlannedPrompt(it.plan, list(it.entries), it.policy, refs=[], prefix=it.prefix)
        for it in items
    ]
    stacked = BatchedPagedKV(items, layers, caches, block_size)
    kvs = [it.kv for it in items]
    return link_pass(adapter, prompts, kvs, stacked, compute_logits=False)
