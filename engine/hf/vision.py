"""Image -> input embeddings with the HF model's own image processor, vision tower and projector
(encoder process: the Serve encoder replica, the reference runner, tests).

Images are NOT resized by this project: the model folder's own image processor
(`AutoProcessor(...).image_processor`, i.e. the class and settings of its
`preprocessor_config.json`) does it, so every image gets exactly the pixels, token count and grid
transformers gives it, whatever its size:

- LLaVA-1.5 (`llava`): CLIP resize of the shortest edge + center crop: a fixed T.
- LLaVA-NeXT / 1.6 (`llava_next`): "anyres": the image is fitted to the best of the config's
  `image_grid_pinpoints`, cut into tiles of the tower's size plus one resized base image; the
  tiles' features are unpadded to the image's aspect ratio and each row of them ends with the
  learned `image_newline` embedding. T = base tokens + unpadded rows x (columns + 1): it depends on
  the image's size.
- Qwen2-VL / Qwen2.5-VL: native resolution: `smart_resize` rounds height and width to multiples
  of patch x merge within [min_pixels, max_pixels] of the processor config; the grid (1, h, w)
  (in 14-px patches, before the 2x2 merge) gives T = h * w / 4 tokens and the M-RoPE layout.
  Qwen2.5-VL's tower uses window attention (the model's own module runs it).

`encode_images` returns, per image, exactly the T rows the HF model writes into its input
embeddings at the image's placeholder tokens (tests capture them from the HF forward), with the
image's grid. Decoding bytes (`load_image`) and an image's T and grid without the tower
(`image_layout`) need no model: they live in `mpic.engine.items` (both backends use them) and are
re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from mpic.engine.items import ImageLayout, image_layout, load_image

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ImageFeatures",
    "ImageLayout",
    "encode",
    "encode_images",
    "image_layout",
    "load_image",
]

_QWEN_TYPES = ("qwen2_vl", "qwen2_5_vl")
SUPPORTED_MODEL_TYPES = ("llava", "llava_next", *_QWEN_TYPES)
"""HF `model_type`s whose vision towers this module drives."""


@dataclass
class ImageFeatures:
    """One image's input embeddings [T, hidden] and its grid (Qwen: (t, h, w); else None)."""

    embeds: torch.Tensor
    grid_thw: tuple[int, int, int] | None = None


@torch.inference_mode()
def encode(model: Any, processor: Any, images: list[Image.Image]) -> list[ImageFeatures]:
    """Input embeddings and grid of each image (`model`: an HF LLaVA, LLaVA-NeXT, Qwen2-VL or
    Qwen2.5-VL `...ForConditionalGeneration`; `processor`: its `AutoProcessor`)."""
    if not images:
        return []
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {config.model_type!r} is not supported")
    rgb = [img.convert("RGB") for img in images]
    inputs = processor.image_processor(images=rgb, return_tensors="pt")
    device, dtype = model.device, model.dtype
    pixels = inputs["pixel_values"].to(device=device, dtype=dtype)
    grids: list[tuple[int, int, int] | None] = [None] * len(images)
    if config.model_type == "llava":
        out = model.model.get_image_features(
            pixel_values=pixels,
            vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
        )
    elif config.model_type == "llava_next":
        out = model.model.get_image_features(
            pixel_values=pixels,
            image_sizes=inputs["image_sizes"].to(device),
            vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
        )
    else:
        grid = inputs["image_grid_thw"]
        out = model.model.get_image_features(pixels, grid.to(device))
        grids = [tuple(int(x) for x in row) for row in grid.tolist()]  # type: ignore[misc]
    return [
        ImageFeatures(feats.reshape(-1, feats.shape[-1]), grid)
        for feats, grid in zip(out.pooler_output, grids, strict=True)
    ]


def encode_images(model: Any, processor: Any, images: list[Image.Image]) -> list[torch.Tensor]:
    """Input embeddings of each image: a list of [T_i, hidden] tensors in the model's dtype
    (T_i differs per image for LLaVA-NeXT and Qwen2-VL/2.5-VL; `encode` also gives the grid)."""
    return [f.embeds for f in encode(model, processor, images)]
