"""Image -> input embeddings with the HF model's own vision tower and projector (encoder process:
the Serve encoder replica, the reference runner, tests).

`encode_images` returns, per image, exactly the T rows the HF model writes into its input
embeddings at the image's placeholder tokens: LLaVA-1.5 runs CLIP, takes the hidden state of
`vision_feature_layer` (-2), drops CLS for the "default" select strategy and applies the 2-layer
MLP projector; Qwen2-VL runs its ViT with 2-D RoPE and the 2x2 patch merger. Every image is first
resized to the model's ONE fixed size (`fit_image`) so T is a model constant (docs/models.md).
"""

from __future__ import annotations

import io
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError

from mpic.errors import UnreadableMediaError
from mpic.model_spec import qwen2vl_side


def load_image(data: bytes) -> Image.Image:
    """Decode image bytes to an RGB PIL image; UnreadableMediaError if they are not an image."""
    if not data:
        raise UnreadableMediaError("empty upload: no image bytes")
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            return img.convert("RGB")
    except (
        UnidentifiedImageError,
        OSError,
        SyntaxError,
        ValueError,
        Image.DecompressionBombError,
    ) as exc:
        raise UnreadableMediaError(f"the bytes are not a decodable image: {exc}") from exc


def fixed_image_size(processor: Any) -> tuple[int, int]:
    """(height, width) every image is resized to, read from an HF LLaVA or Qwen2-VL processor."""
    images = processor.image_processor
    crop = getattr(images, "crop_size", None)
    if crop is not None and getattr(images, "do_center_crop", False):  # CLIP (LLaVA-1.5)
        return int(crop["height"]), int(crop["width"])
    size = getattr(images, "size", None) or {}
    max_pixels = getattr(images, "max_pixels", None) or size.get("longest_edge")
    if max_pixels is None:
        raise ValueError(f"{type(images).__name__} gives no fixed image size")
    side = qwen2vl_side(int(max_pixels), int(images.patch_size), int(images.merge_size))
    return side, side


def fit_image(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    """RGB `image` resized (bicubic, aspect not kept) to `size` = (height, width).

    Apply this wherever an image enters the system (upload, vLLM requests): the processors then
    leave the size unchanged and every image has the same token count T.
    """
    image = image.convert("RGB")
    height, width = size
    if image.size == (width, height):
        return image
    return image.resize((width, height), Image.Resampling.BICUBIC)


@torch.inference_mode()
def encode_images(model: Any, processor: Any, images: list[Image.Image]) -> list[torch.Tensor]:
    """Input embeddings of each image: a list of [T, hidden] tensors in the model's dtype.

    `model` is an HF `LlavaForConditionalGeneration` or `Qwen2VLForConditionalGeneration`,
    `processor` its `AutoProcessor`. Images are fitted to the fixed size first.
    """
    if not images:
        return []
    size = fixed_image_size(processor)
    fitted = [fit_image(img, size) for img in images]
    inputs = processor.image_processor(images=fitted, return_tensors="pt")
    device, dtype = model.device, model.dtype
    pixels = inputs["pixel_values"].to(device=device, dtype=dtype)
    config = model.config
    if config.model_type == "llava":
        out = model.model.get_image_features(
            pixel_values=pixels,
            vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
        )
    elif config.model_type == "qwen2_vl":
        out = model.model.get_image_features(pixels, inputs["image_grid_thw"].to(device))
    else:
        raise ValueError(f"model_type {config.model_type!r} is not supported")
    return [feats.reshape(-1, feats.shape[-1]) for feats in out.pooler_output]
