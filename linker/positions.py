"""Position rules of the model families (linker, all processes).

1-D RoPE (LLaVA / LLaVA-NeXT's Llama/Mistral backbone, text-only models): prompt index = position,
an item advances it by its own token count T (an entry's `num_tokens`: it differs per image with
anyres tiles, and per document).
M-RoPE (Qwen2-VL, Qwen2.5-VL): text tokens get (p, p, p); an image's tokens get 3-D (t, h, w)
positions offset by the text position p where it starts (t = p + frame, h = p + row,
w = p + column of the image's OWN merged patch grid, which depends on its size at native
resolution), and the text after the image continues at max + 1 (transformers'
`Qwen2VLModel.get_rope_index`). An entry stores the positions it was computed at, so linking it
at text position p uses `entry.positions - entry.start_position + p` and advances p by
`entry.position_extent`.
"""

from __future__ import annotations

import torch

from mpic.types import MROPE_FAMILIES, CacheEntry, ModelFamily


def text_positions(family: ModelFamily, start: int, count: int) -> torch.Tensor:
    """Positions of `count` text tokens from `start`: int64 [count] or [3, count] for M-RoPE."""
    pos = torch.arange(start, start + count, dtype=torch.int64)
    return pos.expand(3, -1).clone() if family in MROPE_FAMILIES else pos


def item_positions(family: ModelFamily, entry: CacheEntry, start: int) -> torch.Tensor:
    """Positions of the entry's T tokens when linked at text position `start`."""
    if family in MROPE_FAMILIES:
        rel = entry.positions.reshape(3, -1).to(torch.int64) - entry.start_position
        return rel + start
    return torch.arange(start, start + entry.num_tokens, dtype=torch.int64)


def item_extent(family: ModelFamily, entry: CacheEntry) -> int:
    """How far the item advances the text position (T, or max + 1 - start for M-RoPE)."""
    return entry.position_extent if family in MROPE_FAMILIES else entry.num_tokens


def next_position(positions: torch.Tensor) -> int:
    """The text position after a prompt with these positions ([N] or [3, N]): max + 1."""
    return int(positions.max()) + 1 if positions.numel() else 0


def image_positions(
    family: ModelFamily,
    start: int,
    num_tokens: int,
    grid_thw: tuple[int, int, int] | None = None,
    merge: int = 1,
) -> torch.Tensor:
    """Positions of an image's tokens computed at text position `start` (canonical context).

    1-D: start + arange(T). M-RoPE: (start + frame, start + row, start + column) over the
    merged grid (grid_thw before the spatial merge, as in transformers'
    `get_vision_position_ids`).
    """
    if family not in MROPE_FAMILIES:
        return torch.arange(start, start + num_tokens, dtype=torch.int64)
    assert grid_thw is not None, "M-RoPE needs the image grid"
    t, h, w = grid_thw[0], grid_thw[1] // merge, grid_thw[2] // merge
    assert t * h * w == num_tokens, "grid does not match the token count"
    tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt.flatten(), hh.flatten(), ww.flatten()]).to(torch.int64) + start
