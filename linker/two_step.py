"""The first step of the two-step baselines (full reuse, CacheBlend; MPIC paper sections 2.2 and
5.2): the text tokens' KV computed in a pass of their own, without the items in view, then
written into the prompt's linked KV (linker; reference runner and any engine).

"Full reuse first recomputes the KV cache of text, and then concatenates it with stored KV
caches, and finally computes the first output token with all KV caches" (section 2.2). The text
keeps its positions in the full prompt, so its keys need no rotation when concatenated.

Several prompts' text-first passes are ONE `run_layers` over their stacked text (the link pass
of a batch, `mpic.linker.pipeline.link_pass`): each text row attends to its own prompt's text
alone (`StackedLinkedKV` over per-prompt scratch KVs), so every prompt's text KV is the one its
own pass computes, while each layer's projections and MLP run once for all of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpic.linker.contracts import LayerAdapter
from mpic.linker.kv.dense import DenseLinkedKV
from mpic.linker.kv.linked import LinkedKV
from mpic.linker.kv.stacked import StackedLinkedKV
from mpic.linker.link import cat_parts
from mpic.linker.selective_prefill import run_layers
from mpic.types import LinkPlan


def prefill_text_first(
    adapter: LayerAdapter, prompts: Sequence[tuple[LinkPlan, LinkedKV]]
) -> list[int]:
    """Compute the KV of each (plan, linked KV)'s text tokens, its text alone in view, in one
    pass over the layers, and write it into that linked KV.

    Returns the number of text tokens computed per prompt.
    """
    plans = [plan for plan, _ in prompts]
    texts = [torch.nonzero(plan.is_text).flatten() for plan in plans]
    sizes = [int(t.numel()) for t in texts]
    scratches = [
        DenseLinkedKV(
            adapter.num_layers,
            t,
            adapter.num_kv_heads,
            adapter.head_dim,
            adapter.dtype,
            adapter.device,
        )
        for t in sizes
    ]
    pass_kv: LinkedKV = scratches[0]
    if len(scratches) > 1:
        pass_kv = StackedLinkedKV(scratches, sizes)
    total = sum(sizes)
    if total:
        token_ids = cat_parts([plan.token_ids[t] for plan, t in zip(plans, texts, strict=True)])
        run_layers(
            adapter,
            pass_kv,
            adapter.embed_tokens(token_ids.to(adapter.device)),
            torch.arange(total),  # prompt r's text row i is global index offset_r + i
            cat_parts(
                [plan.positions[..., t] for plan, t in zip(plans, texts, strict=True)], dim=-1
            ),
            torch.full((total,), adapter.num_layers, dtype=torch.int64),
            outputs=torch.zeros(total, dtype=torch.bool),  # their KV alone is read
        )
    # all layers in one write per prompt: one index copy to the device and two index writes,
    # not one blocking copy (a host sync on CUDA) and two writes per layer
    for (_, linked_kv), text_index, scratch in zip(prompts, texts, scratches, strict=True):
        linked_kv.write_layers(text_index, scratch.keys, scratch.values)
    return sizes
