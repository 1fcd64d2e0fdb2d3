"""Glue between the reference runner's dense linked KV and the presses (reference-runner
process): observe the linked prefill, then replace the dense KV by a `CompressedKV`.

link -> recompute (the selective prefill, observed) -> compress (the press) -> decode over the
compressed KV. The dense [L, N + max_new, H_kv, D] tensors are released once compressed, so the
memory held while decoding is the `CompressedKV`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpic.linker.dense_kv import DenseLinkedKV
from mpic.linker.positions import next_position
from mpic.presses.base import BasePress, PressContext
from mpic.presses.cache import CompressedKV
from mpic.presses.observe import ObservedAdapter, ObservedKV, PrefillObserver
from mpic.presses.registry import check_budget, get_press
from mpic.types import LinkPlan


@dataclass
class PressRequest:
    """A press applied to one request: its object (fresh per request) and budget."""

    press: BasePress
    budget: float

    @classmethod
    def make(cls, name: str | None, budget: float | None) -> PressRequest | None:
        """None when no press or budget 1.0 (nothing to compress: bit-identical decoding);
        ValueError for an unknown press or a budget outside (0, 1]."""
        if name is None:
            if budget is not None and check_budget(budget) < 1.0:
                raise ValueError("budget given without a press")
            return None
        press = get_press(name)
        b = check_budget(1.0 if budget is None else budget)
        return None if b >= 1.0 else cls(press, b)


def observer_for(plan: LinkPlan, adapter, window: int = 64) -> PrefillObserver:  # noqa: ANN001
    """A fresh observer for this prompt (is_visual: tokens from entries)."""
    return PrefillObserver(
        adapter.num_layers, plan.num_tokens, adapter.num_kv_heads, plan.source_entry >= 0, window
    )


def observed(adapter, kv: DenseLinkedKV, observer: PrefillObserver):  # noqa: ANN001, ANN201
    """(adapter, kv) wrapped so the prefill reports to `observer`."""
    return ObservedAdapter(adapter, observer), ObservedKV(kv, observer)


def compress_dense(
    req: PressRequest,
    kv: DenseLinkedKV,
    observer: PrefillObserver,
    plan: LinkPlan,
    adapter,  # noqa: ANN001
    extra: int,
) -> CompressedKV:
    """The press over every layer of the prefilled dense KV -> a CompressedKV with room for
    `extra` decoded tokens. The caller drops `kv` afterwards."""
    n = plan.num_tokens
    keys = [kv.keys[layer, :n].transpose(0, 1) for layer in range(adapter.num_layers)]
    values = [kv.values[layer, :n].transpose(0, 1) for layer in range(adapter.num_layers)]
    ctx = PressContext(
        num_tokens=n,
        is_visual=plan.source_entry >= 0,
        next_position=next_position(plan.positions),
        mrope=plan.positions.dim() == 2,
        adapter=adapter,
    )
    with torch.inference_mode():
        return req.press.compress(keys, values, observer.layers, ctx, req.budget, extra)


def dense_nbytes(kv: DenseLinkedKV) -> int:
    """Bytes of a dense linked KV's storage (K and V)."""
    return kv.keys.nbytes + kv.values.nbytes
