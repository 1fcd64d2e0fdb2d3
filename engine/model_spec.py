"""What the linker and engines need to know about a model folder (all processes).

`ModelSpec.from_pretrained(path)` reads an HF folder's config and tokenizer; the linker uses it to
lay out prompts (placeholder ids, tokens per image, M-RoPE rules), engines to size KV.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpic.engine.adapter import RopeSpec
from mpic.types import ModelFamily


@dataclass(frozen=True)
class ModelSpec:
    """Static facts about one model. Qwen2-VL-only fields are None for LLaVA."""

    family: ModelFamily
    path: str
    fingerprint: str
    """sha256 over the config and weight files: part of every cache entry's key."""
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_model_len: int
    rope: RopeSpec
    image_token_id: int
    """The placeholder id every image token carries in the prompt."""
    tokens_per_image: int
    """T: the processor resizes every image to one fixed size, so T is a model constant."""
    image_size: tuple[int, int]
    """(height, width) the processor resizes images to."""
    vision_start_id: int | None = None
    vision_end_id: int | None = None
    image_grid_thw: tuple[int, int, int] | None = None
    """Qwen2-VL: the (t, h, w) patch grid before the spatial merge."""
    spatial_merge_size: int | None = None
