"""Small synthetic cache entries for the storage tests (no model needed)."""

from __future__ import annotations

import torch

from mpic.addressing import entry_key
from mpic.types import CacheEntry


def make_entry(
    seed: int,
    *,
    layers: int = 2,
    tokens: int = 16,
    heads: int = 2,
    dim: int = 8,
    hidden: int = 32,
    dtype: torch.dtype = torch.float32,
    mrope: bool = False,
    media: bytes | None = None,
) -> CacheEntry:
    """A random entry keyed by its (fingerprint, context, media) like a real one."""
    g = torch.Generator().manual_seed(seed)
    media = media if media is not None else f"media-{seed}".encode()
    shape = (layers, tokens, heads, dim)
    pos = torch.arange(5, 5 + tokens)
    if mrope:
        pos = torch.stack([pos, pos + 1, pos + 2])
    return CacheEntry(
        entry_id=entry_key("tiny-fp", "<sys>canonical", media),
        model_fingerprint="tiny-fp",
        keys=torch.randn(shape, generator=g).to(dtype),
        values=torch.randn(shape, generator=g).to(dtype),
        positions=pos,
        input_embeds=torch.randn(tokens, hidden, generator=g).to(dtype),
        extra={"image_grid_thw": [1, 4, 4]} if mrope else {},
    )


def assert_same(a: CacheEntry, b: CacheEntry) -> None:
    """Bit-exact equality of two entries."""
    assert a.entry_id == b.entry_id and a.model_fingerprint == b.model_fingerprint
    assert a.media_type == b.media_type and a.extra == b.extra
    for name in ("keys", "values", "positions", "input_embeds"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x, y), name
