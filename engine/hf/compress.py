"""Glue between the reference runner's dense linked KV and the presses (reference-runner
process): observe the linked prefill, then replace the dense KV by a `CompressedKV`.

link -> recompute (the selective prefill, observed) -> compress (the press) -> decode over the
compressed KV. The dense [L, N + max_new, H_kv, D] tensors are released once compressed, so the
memory held while decoding is the `CompressedKV`'s.

The uniform-across-layers variant on cached items (`mpic.presses.entries`) is shared by both
engines (`mpic.engine.item_press`: the item's canonical prefill, observed, over any
`LayerAdapter` and `LinkedKV`); `press_entry_dense` runs it over a fresh dense KV here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpic.engine.item_press import (
    canonical_planned,
    observed,
    observer_for,
    press_context,
    press_item_entry,
)
from mpic.kernels.attention_backend import AttentionBackend
from mpic.linker.kv.dense import DenseLinkedKV
from mpic.model_spec import ModelSpec
from mpic.presses.base import BasePress
from mpic.presses.cache import CompressedKV
from mpic.presses.observe import PrefillObserver
from mpic.presses.registry import check_budget, get_press
from mpic.types import CacheEntry, LinkPlan

__all__ = [  # the observer helpers and the item press (`mpic.engine.item_press`) re-exported
    "PressRequest",
    "canonical_planned",
    "compress_dense",
    "dense_nbytes",
    "observed",
    "observer_for",
    "press_entry_dense",
    "press_item_entry",
]


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
    ctx = press_context(plan, adapter)
    with torch.inference_mode():
        return req.press.compress(keys, values, observer.layers, ctx, req.budget, extra)


def dense_nbytes(kv: DenseLinkedKV) -> int:
    """Bytes of a dense linked KV's storage (K and V)."""
    return kv.keys.nbytes + kv.values.nbytes


def press_entry_dense(
    adapter,  # noqa: ANN001
    spec: ModelSpec,
    entry: CacheEntry,
    press: str,
    budget: float,
    backend: str | AttentionBackend | None = None,
) -> CacheEntry:
    """`press_item_entry` over a fresh dense KV (the reference runner's variant)."""
    planned = canonical_planned(spec, entry)
    a = adapter
    kv = DenseLinkedKV(
        a.num_layers,
        planned.plan.num_tokens,
        a.num_kv_heads,
        a.head_dim,
        a.dtype,
        a.device,
        backend=backend,
    )
    return press_item_entry(a, planned, kv, press, budget)
