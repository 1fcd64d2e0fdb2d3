"""The seam between a request's paged linked KV (`mpic.engine.vllm.connector.paged_kv`) and one
cache layout (vLLM worker process): clear, write slots, read keys, gather, shift keys in place
(for vLLM's last token), attend. One implementation per layout: `paged_cpu.CpuPagedOps`,
`paged_cuda.FlashPagedOps`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class PagedKVOps(ABC):
    """Writes and attention over one request's blocks in one cache layout (all layers)."""

    readable: bool = False
    """True when `read_keys` reads the cache itself (no dense key mirror needed)."""

    @property
    @abstractmethod
    def num_kv_heads(self) -> int:
        """KV heads per layer in the cache."""

    @abstractmethod
    def clear(self) -> None:
        """Zero the request's blocks in every layer (the "dummy cache")."""

    @abstractmethod
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [S, H_kv, D] at cache slots int64 [S] of `layer`."""

    def read_keys(self, layer: int, slots: torch.Tensor) -> torch.Tensor | None:
        """Keys at `slots` of `layer` [S, H_kv, D], or None where the layout is opaque."""
        return None

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at `slots` of `layer` [S, H_kv, D] each (readable layouts only)."""
        raise NotImplementedError(f"{type(self).__name__} cannot read its cache")

    def locate(self, slots: torch.Tensor) -> Any:
        """Where `slots` lie in any layer's cache, for `read_located` (kept across layers: the
        caches share one shape). Default: the slots themselves."""
        return slots

    def read_located(self, layer: int, where: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """`read` at slots already located by `locate`."""
        return self.read(layer, where)

    def shift_place(self, slots: torch.Tensor) -> Any | None:
        """Where keys at cache slots `slots` can be shifted in place (`shift_keys`, kept across
        layers), or None where this layout cannot (the caller reads and writes the rows)."""
        return None

    def shift_keys(self, layer: int, place: Any, delta: torch.Tensor) -> Any:
        """Add delta [H_kv, D] to the keys at `place` (`shift_place`) of `layer`, in place;
        returns what `unshift_keys` writes back (the true keys, exactly)."""
        raise NotImplementedError(f"{type(self).__name__} cannot shift keys in place")

    def unshift_keys(self, layer: int, place: Any, saved: Any) -> None:
        """Undo `shift_keys` of `layer` bit-exactly from what it returned."""
        raise NotImplementedError(f"{type(self).__name__} cannot shift keys in place")

    def gather(
        self, layer: int, num_keys: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The request's keys and values of `layer` by prompt index ([B * bs, H_kv, D] each;
        with `num_keys`, at least the blocks holding [0, num_keys) may be all that is read), or
        None where the layout is opaque (the linked-key correction then reads mirrors)."""
        return None

    def scale(self, layer: int) -> float | None:
        """The layer's softmax scale (None: D ** -0.5)."""
        return None

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """q [S, H, D] at ascending prompt indices `index` -> [S, H, D], causal by index."""
