"""Batched linking: the linked requests of one step in ONE selective pass (vLLM worker).

MPIC's selective prefill (docs/design.md "Selective prefill") runs a prompt's recomputed tokens
layer by layer over its linked KV. Done per request, a step that links 8 requests runs 8 passes
of L layers of small matmuls. Here the requests' recomputed tokens are concatenated into one
virtual prompt: request r's prompt index p becomes g = offset_r + p, so `run_layers` (the same
code as one prompt) runs each layer's norms, projections and MLP once over all of them, and
`BatchedPagedKV` routes the two cache operations per layer:

- write: one `cpu_attn_reshape_and_cache` with every token's own slot
  (`block_ids_r[p // bs] * bs + p % bs`);
- attend: ONE `cpu_attention_with_kv_cache` call per layer; every contiguous run of a request's
  queries is a virtual sequence with that request's block table and sequence length p_end + 1,
  so each query sees exactly its own request's keys up to its own prompt index (a per-request
  causal mask over its own blocks, the exact mask of the one-request pass).

On other devices (CUDA), and when a request of the batch carries the linked-key correction
(its corrected attention reads its own K/V mirrors), the two operations loop over the requests'
`PagedLinkedKV`s (one call each); the layer compute is still shared.

Each request is prepared alone by the linker's `prepare_pass` (the same code as the one-request
`link_and_prefill`: its entries and cached prefix linked, a scouting policy's scout run over its
own text, its correction set), then the recomputed tokens of all of them run the layers
together. Policies whose pass needs the whole prompt to itself stay on the one-request path
(`link_job.joins_batch`: two-step policies, in-pass hooks), as do compression requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mpic.engine.vllm.connector.paged_cpu import CpuPagedOps, cpu_attend_sequences
from mpic.engine.vllm.connector.paged_kv import PagedLinkedKV
from mpic.linker.contracts import LayerAdapter
from mpic.linker.pipeline import prepare_pass
from mpic.linker.policies import Policy
from mpic.linker.prefix import CachedPrefix
from mpic.linker.recipe import PlannedPrompt
from mpic.linker.selective_prefill import run_layers
from mpic.types import CacheEntry, LinkPlan


@dataclass
class BatchItem:
    """One request of a batch: its plan (the front end's depths), entries, policy and paged
    KV (with K/V mirrors when the policy corrects: `PagedLinkedKV.set_correction`)."""

    plan: LinkPlan
    entries: Sequence[CacheEntry]
    kv: PagedLinkedKV
    block_ids: list[int]
    policy: Policy
    prefix: CachedPrefix | None = None
    """The template/system prefix linked exactly (`mpic.linker.prefix`: `prepare_pass` writes
    it and gives its tokens depth 0), or None."""


class BatchedPagedKV:
    """`LinkedKV` over several requests' paged blocks (see the module docstring).

    items: the requests in batch order; offsets[r]: first global index of request r; layers,
    caches: vLLM's per-layer Attention modules and KV tensors; block_size: vLLM's."""

    def __init__(
        self,
        items: Sequence[BatchItem],
        layers: list[nn.Module],
        caches: list[torch.Tensor],
        block_size: int,
    ) -> None:
        self._items = list(items)
        self._layers, self._caches, self._bs = layers, caches, block_size
        sizes = [it.plan.num_tokens for it in self._items]
        self.offsets = torch.tensor([0, *sizes]).cumsum(0)
        self.total = int(self.offsets[-1])
        self._req = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
        slots = []
        for it in self._items:
            blocks = torch.tensor(it.block_ids, dtype=torch.int64)
            p = torch.arange(it.plan.num_tokens)
            slots.append(blocks[p // block_size] * block_size + p % block_size)
        device = caches[0].device
        self._slots = torch.cat(slots).to(device)
        # one CPU op call per layer for all requests, unless a request attends through its own
        # mirrors (the correction): then, as on CUDA, each request's KV serves its rows
        self._cpu = device.type == "cpu" and not any(it.kv.mirrored for it in self._items)
        if self._cpu:
            width = max(len(it.block_ids) for it in self._items)
            table = torch.zeros(len(self._items), width, dtype=torch.int32)
            for r, it in enumerate(self._items):
                table[r, : len(it.block_ids)] = torch.tensor(it.block_ids, dtype=torch.int32)
            self._tables = table
            unused = torch.zeros(1, dtype=torch.int64)  # writes take slots, not blocks
            self._writer = CpuPagedOps(layers, caches, unused, block_size)
        self._split: tuple[torch.Tensor, list[tuple[int, int, int, torch.Tensor]]] | None = None
        """(the global index object last split, [(a, b, r, request r's local index)])."""

    def _pieces(self, index: torch.Tensor) -> list[tuple[int, int, int]]:
        """Rows [a, b) of `index` (ascending global indices) that are contiguous and in one
        request r: [(a, b, r)]."""
        return self._ranges(index, contiguous=True)

    def _requests(self, index: torch.Tensor) -> list[tuple[int, int, int]]:
        """Rows [a, b) of `index` (ascending global indices) that belong to request r, one
        range per request present: [(a, b, r)] (a request's rows are contiguous, requests being
        laid out in order)."""
        return self._ranges(index, contiguous=False)

    def _ranges(self, index: torch.Tensor, contiguous: bool) -> list[tuple[int, int, int]]:
        """Rows of `index` cut where the request changes (and, with `contiguous`, where the
        global indices jump)."""
        host = index.cpu()
        if host.numel() == 0:
            return []
        req = self._req[host]
        cut = req[1:] != req[:-1]
        if contiguous:
            cut |= host[1:] != host[:-1] + 1
        breaks = torch.nonzero(cut).flatten() + 1
        edges = [0, *breaks.tolist(), int(host.shape[0])]
        return [(a, b, int(req[a])) for a, b in zip(edges[:-1], edges[1:], strict=False)]

    def _by_request(self, index: torch.Tensor) -> list[tuple[int, int, int, torch.Tensor]]:
        """`_requests(index)` with each request's local index, computed once per index object:
        `run_layers` hands the same object to every layer until the active set changes, and a
        request's attention keeps its prepared masks while it gets the same local object."""
        if self._split is None or self._split[0] is not index:
            split = [
                (a, b, r, index[a:b] - int(self.offsets[r])) for a, b, r in self._requests(index)
            ]
            self._split = (index, split)
        return self._split[1]

    def write(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite global indices `index` [S] of `layer` with k, v [S, H_kv, D]."""
        if self._cpu:
            self._writer.write(layer, self._slots[index.to(self._slots.device)], k, v)
            return
        for a, b, r, local in self._by_request(index):
            self._items[r].kv.write(layer, local, k[a:b], v[a:b])

    def read_keys(self, layer: int, index: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("the batched pass runs no in-pass hook (`joins_batch`)")

    def attend(self, layer: int, q: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """q [S, H, D] at ascending global indices -> [S, H, D], each row over its own
        request's keys [0, p]."""
        if not self._cpu:  # one call per request over all its rows
            out = torch.empty_like(q)
            for a, b, r, local in self._by_request(index):
                out[a:b] = self._items[r].kv.attend(layer, q[a:b], local)
            return out
        return self._cpu_attend(layer, q, index, self._pieces(index))

    def _cpu_attend(
        self, layer: int, q: torch.Tensor, index: torch.Tensor, pieces: list[tuple[int, int, int]]
    ) -> torch.Tensor:
        host = index.cpu()
        starts = torch.tensor([0] + [b for _, b, _ in pieces], dtype=torch.int32)
        seq_lens = torch.tensor(
            [int(host[b - 1]) - int(self.offsets[r]) + 1 for _, b, r in pieces], dtype=torch.int32
        )
        block_table = self._tables[[r for _, _, r in pieces]].contiguous()
        return cpu_attend_sequences(
            self._layers[layer], self._caches[layer], q, starts, seq_lens, block_table
        )


def link_batch(
    adapter: LayerAdapter,
    items: Sequence[BatchItem],
    layers: list[nn.Module],
    caches: list[torch.Tensor],
    block_size: int,
) -> list[LinkPlan]:
    """Link every request of `items` in one selective pass: each request's blocks are zeroed
    and prepared alone (`prepare_pass`), then the recomputed tokens of all of them run the
    layers together. Returns each request's plan with its final depths. No logits (vLLM's
    forward computes the last token)."""
    embeds, index, positions, depth, plans = [], [], [], [], []
    prepared = []
    for it in items:
        it.kv.clear()
        planned = PlannedPrompt(it.plan, it.entries, it.policy, refs=[], prefix=it.prefix)
        prepared.append(prepare_pass(adapter, planned, it.kv))
    batched = BatchedPagedKV(items, layers, caches, block_size)
    for r, p in enumerate(prepared):
        plans.append(p.plan)
        assert p.hook is None, "in-pass hooks do not join a batch (`joins_batch`)"
        if p.index.numel() == 0:
            continue
        embeds.append(p.embeds)
        index.append(p.index + int(batched.offsets[r]))
        positions.append(p.plan.positions[..., p.index])
        depth.append(p.plan.recompute_depth[p.index])
    if index:
        run_layers(
            adapter,
            batched,
            torch.cat(embeds),
            torch.cat(index),
            torch.cat(positions, dim=-1),
            torch.cat(depth),
        )
    return plans
