"""The first step of the two-step baselines (full reuse, CacheBlend; MPIC paper sections 2.2 and
5.2): the text tokens' KV computed in a pass of their own, without the items in view, then
written into the prompt's linked KV (linker; reference runner and any engine).

"Full reuse first recomputes the KV cache of text, and then concatenates it with stored KV
caches, and finally computes the first output token with all KV caches" (section 2.2). The text
keeps its positions in the full prompt, so its keys need no rotation when concatenated.
"""

from __future__ import annotations

import torch

from mpic.linker.contracts import LayerAdapter
from mpic.linker.kv.dense import DenseLinkedKV
from mpic.linker.kv.linked import LinkedKV
from mpic.linker.selective_prefill import run_layers
from mpic.types import LinkPlan


def prefill_text_first(adapter: LayerAdapter, plan: LinkPlan, linked_kv: LinkedKV) -> int:
    """Compute the KV of the plan's text tokens alone and write it into `linked_kv`.

    Returns the number of text tokens computed.
    """
    text_index = torch.nonzero(plan.is_text).flatten()
    t = int(text_index.numel())
    scratch = DenseLinkedKV(
        adapter.num_layers, t, adapter.num_kv_heads, adapter.head_dim, adapter.dtype, adapter.device
    )
    embeds = adapter.embed_tokens(plan.token_ids[text_index].to(adapter.device))
    run_layers(
        adapter,
        scratch,
        embeds,
        torch.arange(t),
        plan.positions[..., text_index],
        torch.full((t,), adapter.num_layers, dtype=torch.int64),
        outputs=torch.zeros(t, dtype=torch.bool),  # their KV alone is read
    )
    for layer in range(adapter.num_layers):
        linked_kv.write(layer, text_index, scratch.keys[layer], scratch.values[layer])
    return t
