"""One-pass selective-attention prefill (MPIC paper section 4.1, Fig. 7; engine-agnostic: runs in
the reference runner with HF modules and in the vLLM worker with vLLM's modules).

Only recomputed tokens run through the layers. At layer l the active tokens are those with
`plan.recompute_depth > l` (a non-increasing set: VLCache section 4.1 drops tokens from the
layer where their ratio ends and they skip that layer's attention and MLP). At every layer the
active tokens' fresh K/V overwrite their slots in the linked KV (cached rotated item KV, zeros
for text: the "dummy cache"), then their queries attend over ALL linked keys with an exact causal
mask by prompt index (`LinkedKV.attend`). So linking is one pass, not "text first, then reuse".

`run_layers` is the pass; the link pass (`mpic.linker.pipeline.link_pass`, any engine) links
the prompts, gathers their recomputed tokens' inputs and runs it once for all of them.

No transformers or vLLM import here: `adapter` is a `mpic.linker.contracts.LayerAdapter`,
`linked_kv` a `mpic.linker.kv.linked.LinkedKV`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from mpic.linker.contracts import LayerAdapter
from mpic.linker.kv.linked import LinkedKV


class LayerHook(Protocol):
    """A dynamic token selection inside the pass (CacheBlend's KV-deviation check)."""

    def acts_at(self, layer: int) -> bool:
        """True at the layers where `select` may return a mask (it returns None elsewhere): a
        batch asks each request's hook only there (`mpic.linker.pipeline`), so the layers
        where none acts cost no host sync."""
        ...

    def select(
        self, layer: int, index: torch.Tensor, k: torch.Tensor, linked_kv: LinkedKV
    ) -> torch.Tensor | None:
        """Called at `layer` after the fresh keys k [S, H_kv, D] of the active tokens at prompt
        indices `index` [S] are computed, BEFORE they are written. Returns a bool [S] mask of the
        tokens that stay active from this layer on (the others keep their linked KV), or None."""
        ...


@dataclass
class PrefillResult:
    """What the pass leaves besides the filled linked KV."""

    logits: torch.Tensor | None
    """float32 [vocab]: next-token logits of the last prompt token (None if not asked)."""
    recompute_depth: torch.Tensor
    """int64 [N]: the depth each token actually ran to (differs from the plan under a hook)."""


def run_layers(
    adapter: LayerAdapter,
    linked_kv: LinkedKV,
    hidden: torch.Tensor,
    index: torch.Tensor,
    positions: torch.Tensor,
    depth: torch.Tensor,
    hook: LayerHook | None = None,
    outputs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run tokens through the decoder layers, each until its depth.

    hidden [S, hidden] input embeddings of the tokens at prompt indices `index` (int64 [S],
    ascending), positions [S] or [3, S], depth int64 [S] (layers each token runs; > 0);
    outputs: bool [S], the tokens whose final hidden state the caller reads (None: every token
    that runs every layer). Returns (hidden [S', hidden] of the output tokens that ran every
    layer, their index [S'] (host), the final depth of all S tokens [S] (host)).

    The last layer a token runs writes its K/V and stops there: its attention output and MLP
    run only if a later layer or the caller reads its hidden state (vLLM computes a linked
    prompt's last token itself, so its link pass reads none: a 1/L share of the pass's
    projections and MLP saved). The outputs are unchanged.

    No host<->device sync and no host-to-device copy in the layer loop: the depths stay on the
    host and decide there which tokens go on after each layer; index and positions move to the
    model's device once, and the row gathers of every layer where the active set shrinks are
    planned before the loop and moved in one copy (`_planned_cuts`; integer gathers: boolean
    masks would sync). The same index tensor object is handed to every layer until the set
    shrinks, so the linked KV's attention backend builds its mask once. A hook (CacheBlend) may
    sync at its check layer, and the gathers after it are planned again for the tokens left.
    """
    dev, last = adapter.device, adapter.num_layers - 1
    depth = depth.cpu().clone()
    host_index = index.cpu()
    read = torch.ones_like(depth, dtype=torch.bool) if outputs is None else outputs.cpu()
    rows = torch.arange(host_index.shape[0])  # row of each active token in the caller's arrays
    idx, pos = host_index.to(dev), positions.to(dev)  # the active tokens', on the device
    cuts = _planned_cuts(depth, read, last, dev)

    for layer in range(adapter.num_layers):
        if rows.numel() == 0:  # no tokens given, or a hook dropped them all
            return hidden[:0], host_index[:0], depth
        q, k, v = adapter.attention_inputs(layer, hidden, pos)
        if hook is not None:
            chosen = hook.select(layer, idx, k, linked_kv)
            if chosen is not None:
                chosen = chosen.cpu()
                if not bool(chosen.all()):
                    depth[rows[~chosen]] = layer
                    take = torch.nonzero(chosen).flatten().to(dev)
                    q, k, v, hidden = q[take], k[take], v[take], hidden[take]
                    idx, pos = idx[take], pos[..., take]
                    rows = rows[chosen]
                    cuts = _planned_cuts(depth[rows], read[rows], last, dev)  # the rows left
        linked_kv.write(layer, idx, k, v)
        cut = cuts.get(layer)
        if cut is None:  # every active token goes on
            attn = linked_kv.attend(layer, q, idx)
            hidden = adapter.attention_output_and_mlp(layer, hidden, attn)
            continue
        if cut.host.numel() == 0:  # nobody reads on: this layer's K/V were all that was needed
            return hidden[:0], host_index[:0], depth
        rows, take = rows[cut.host], cut.device
        attn = linked_kv.attend(layer, q, idx)[take]  # the same index: one mask per set
        hidden, idx, pos = hidden[take], idx[take], pos[..., take]
        hidden = adapter.attention_output_and_mlp(layer, hidden, attn)
    return hidden, host_index[rows], depth


@dataclass
class _Cut:
    """The rows that go on after a layer, among those active at it: int64 [S'] on the host and
    the same on the model's device (the gather)."""

    host: torch.Tensor
    device: torch.Tensor


def _planned_cuts(
    depth: torch.Tensor, read: torch.Tensor, last: int, device: torch.device
) -> dict[int, _Cut]:
    """The layers after which run_layers' active set shrinks (a token's last layer: depth - 1;
    at the last layer, the rows not read), each with the rows, among those active at it, that
    go on (empty: none does, and the pass ends there); their device copies built on the host
    and moved in one copy. depth int64 [S] (> 0), read bool [S], both on the host."""
    rows = torch.arange(depth.shape[0])
    kept: dict[int, torch.Tensor] = {}
    for layer in sorted({int(d) - 1 for d in depth.unique()} | {last}):
        goes_on = depth[rows] > layer + 1 if layer < last else read[rows]
        if bool(goes_on.all()):
            continue
        kept[layer] = torch.nonzero(goes_on).flatten()
        rows = rows[goes_on]
        if rows.numel() == 0:
            break
    if not kept:
        return {}
    moved = torch.cat(list(kept.values())).to(device).split([int(t.numel()) for t in kept.values()])
    return {layer: _Cut(t, d) for (layer, t), d in zip(kept.items(), moved, strict=True)}
