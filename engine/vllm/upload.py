"""Upload path through vLLM: a cache entry computed by vLLM's own forward (vLLM worker process).

MPIC section 3.1 (Fig. 5): on upload the LLM worker computes the KV of [canonical context + item]
and writes it to the store. Here the canonical prompt runs as an ordinary vLLM request (with its
image, through vLLM's vision tower; a text document is its own token ids, no multimodal data,
media type "text") whose `kv_transfer_params` carry `{"mpic_upload": {...}}`:
entry id, model fingerprint and the item's token span [start, end). In the worker the connector
arms `KVCapture` around that step's forward: forward pre-hooks on the first decoder layer (input
embeddings, positions) and on every layer's `Attention` module (post-RoPE K and V, exactly what vLLM
writes to its cache) copy the request's rows; when the whole prompt has run, the item's rows
become a `CacheEntry` (keys [L, T, H_kv, D], values, positions [T] or [3, T], input_embeds
[T, hidden]) written through the entry store. Uploads get a unique `cache_salt`, so vLLM's
prefix cache never skips their tokens.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mpic.engine.vllm.connector.adapter import VllmLayerAdapter, language_model
from mpic.types import CacheEntry

logger = logging.getLogger(__name__)

KEY = "mpic_upload"
"""The key of `kv_transfer_params` that marks an upload request."""


def upload_params(
    entry_id: str,
    fingerprint: str,
    start: int,
    end: int,
    media_type: str = "image",
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`kv_transfer_params` of an upload: capture prompt tokens [start, end) as entry `entry_id`."""
    body = {
        "entry_id": entry_id,
        "fingerprint": fingerprint,
        "start": start,
        "end": end,
        "media_type": media_type,
        "extra": extra or {},
    }
    return {KEY: body}


def is_upload(params: dict[str, Any] | None) -> bool:
    """True when `kv_transfer_params` mark an upload request."""
    return bool(params) and KEY in params


@dataclass
class _Buffer:
    params: dict[str, Any]
    rows: tuple[int, int] = (0, 0)
    embeds: list[torch.Tensor] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)
    keys: list[list[torch.Tensor]] = field(default_factory=list)
    values: list[list[torch.Tensor]] = field(default_factory=list)

    @property
    def captured(self) -> int:
        return sum(int(e.shape[0]) for e in self.embeds)


class KVCapture:
    """Copies the rows of upload requests out of vLLM's forward (hooks stay installed, idle
    unless a step is armed)."""

    def __init__(self, model: nn.Module, adapter: VllmLayerAdapter) -> None:
        self._adapter = adapter
        self._active: dict[str, _Buffer] = {}
        self._armed = False
        first = language_model(model).model.layers[0]  # its input is the input embeddings
        self._first_sig = inspect.signature(first.forward)
        first.register_forward_pre_hook(self._on_first_layer, with_kwargs=True)
        for layer in range(adapter.num_layers):
            adapter.attention_layer(layer).register_forward_pre_hook(self._on_attention(layer))

    def begin_step(self, new: dict[str, dict[str, Any]], runner: Any, attn_metadata: Any) -> None:
        """Start capturing `new` requests (req_id -> upload params) and arm this step's rows."""
        for req_id, params in new.items():
            self._active[req_id] = _Buffer(params[KEY], keys=[], values=[])
        if not self._active:
            return
        meta = next(iter(attn_metadata.values())) if isinstance(attn_metadata, dict) else None
        if meta is None:
            return
        starts = meta.query_start_loc.tolist()
        index = runner.input_batch.req_id_to_index
        for req_id, buf in self._active.items():
            i = index.get(req_id)  # not in this batch (waiting): capture nothing this step
            buf.rows = (starts[i], starts[i + 1]) if i is not None else (0, 0)
        self._armed = True

    def end_step(self, put: Callable[[CacheEntry], Any]) -> None:
        """Disarm; turn every request whose prompt has fully run into an entry and `put` it."""
        self._armed = False
        for req_id in list(self._active):
            buf = self._active[req_id]
            if buf.captured >= buf.params["end"]:
                put(self._entry(buf))
                del self._active[req_id]

    def _on_first_layer(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._armed:
            return
        bound = self._first_sig.bind(*args, **kwargs).arguments
        embeds, positions = bound["hidden_states"], bound["positions"]
        for buf in self._active.values():
            a, b = buf.rows
            buf.embeds.append(embeds[a:b].detach().clone())
            buf.positions.append(positions[..., a:b].detach().clone())
            buf.keys.append([])
            buf.values.append([])

    def _on_attention(self, layer: int) -> Callable[[nn.Module, tuple], None]:
        h_kv, d = self._adapter.num_kv_heads, self._adapter.head_dim

        def hook(module: nn.Module, args: tuple) -> None:
            if not self._armed:
                return
            _, key, value = args[:3]
            for buf in self._active.values():
                a, b = buf.rows
                buf.keys[-1].append(key[a:b].reshape(b - a, h_kv, d).detach().clone())
                buf.values[-1].append(value[a:b].reshape(b - a, h_kv, d).detach().clone())

        return hook

    def _entry(self, buf: _Buffer) -> CacheEntry:
        p = buf.params
        a, b = p["start"], p["end"]
        keys = torch.cat([torch.stack(step) for step in buf.keys], dim=1)  # [L, P, H_kv, D]
        values = torch.cat([torch.stack(step) for step in buf.values], dim=1)
        positions = torch.cat(buf.positions, dim=-1).to(torch.int64)
        return CacheEntry(
            entry_id=p["entry_id"],
            model_fingerprint=p["fingerprint"],
            keys=keys[:, a:b].contiguous(),
            values=values[:, a:b].contiguous(),
            positions=positions[..., a:b].contiguous(),
            input_embeds=torch.cat(buf.embeds)[a:b].contiguous(),
            media_type=p["media_type"],
            extra=dict(p["extra"]),
        )
