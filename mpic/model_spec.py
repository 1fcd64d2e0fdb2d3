"""What the linker and engines need to know about a model folder (all processes).

`ModelSpec.from_pretrained(path)` reads an HF folder's config (through transformers' AutoConfig,
which fills the defaults real checkpoints leave out and upgrades legacy layouts) and its image
processor config, so the linker can lay out prompts (placeholder ids, tokens per image, M-RoPE
rules) and engines can size KV. docs/models.md lists the prompt conventions.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpic.addressing import model_fingerprint
from mpic.types import ModelFamily

_MODEL_TYPES: dict[str, ModelFamily] = {"llava": "llava", "qwen2_vl": "qwen2-vl"}


@dataclass(frozen=True)
class RopeSpec:
    """What the RoPE delta rotation needs to know about a model's rotary embedding.

    `mrope_section` is None for 1-D RoPE; for M-RoPE it lists how many rotary frequency pairs use
    the temporal, height and width position (Qwen2-VL: [16, 24, 24] for head size 128).
    """

    head_dim: int
    theta: float
    mrope_section: tuple[int, ...] | None = None


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
    bos_token_id: int | None = None
    """Prepended to every prompt when not None (LLaVA/Llama); Qwen2-VL prompts have no BOS."""
    eos_token_id: int | None = None
    """Ends an assistant turn: `</s>` (LLaVA) or `<|im_end|>` (Qwen2-VL)."""

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> ModelSpec:
        """Read an HF model folder (LLaVA-1.5-style or Qwen2-VL).

        Raises FileNotFoundError if the folder has no config.json and ValueError for an
        unsupported model type or a processor that does not give a fixed image size.
        """
        root = Path(path).resolve()
        config = _read_json(root / "config.json")
        family = _MODEL_TYPES.get(config.get("model_type", ""))
        if family is None:
            raise ValueError(
                f"{root}: model_type {config.get('model_type')!r} is not supported; "
                f"supported: {sorted(_MODEL_TYPES)}"
            )
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(root).to_dict()  # defaults filled in
        text = config["text_config"]
        heads = int(text["num_attention_heads"])
        rope = rope_spec(text)
        image = _image_processor_config(root)
        common: dict[str, Any] = {
            "family": family,
            "path": str(root),
            "fingerprint": model_fingerprint(root),
            "num_layers": int(text["num_hidden_layers"]),
            "num_heads": heads,
            "num_kv_heads": int(text.get("num_key_value_heads") or heads),
            "head_dim": rope.head_dim,
            "hidden_size": int(text["hidden_size"]),
            "vocab_size": int(text["vocab_size"]),
            "max_model_len": int(text["max_position_embeddings"]),
            "rope": rope,
            "eos_token_id": _first(text.get("eos_token_id")),
        }
        if family == "llava":
            return cls(**common, **_llava_fields(config, image))
        return cls(**common, **_qwen2vl_fields(config, image))


def rope_spec(text: dict[str, Any]) -> RopeSpec:
    """The RoPE of an HF text config (as a dict): head size, theta and the M-RoPE section."""
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", text.get("rope_theta", 10000.0)))
    section = params.get("mrope_section")
    return RopeSpec(head_dim, theta, tuple(int(x) for x in section) if section else None)


def _llava_fields(config: dict[str, Any], image: dict[str, Any]) -> dict[str, Any]:
    """LLaVA-1.5: CLIP patches of the cropped square image, minus CLS for the 'default' select."""
    vision = config["vision_config"]
    crop = image.get("crop_size") or {}
    side = int(crop.get("height") or vision["image_size"])
    width = int(crop.get("width") or side)
    patch = int(vision["patch_size"])
    tokens = (side // patch) * (width // patch)
    if config.get("vision_feature_select_strategy", "default") == "full":
        tokens += 1
    return {
        "image_token_id": int(
            config["image_token_index"]
            if config.get("image_token_index") is not None
            else config["image_token_id"]
        ),
        "tokens_per_image": tokens,
        "image_size": (side, width),
        "bos_token_id": _first(config["text_config"].get("bos_token_id")),
    }


def _qwen2vl_fields(config: dict[str, Any], image: dict[str, Any]) -> dict[str, Any]:
    """Qwen2-VL: a square image of the largest side with side**2 <= max_pixels that is a multiple
    of patch * merge (docs/models.md: callers resize with `vision.fit_image` first)."""
    vision = config["vision_config"]
    patch = int(image.get("patch_size") or vision["patch_size"])
    merge = int(image.get("merge_size") or vision["spatial_merge_size"])
    size = image.get("size") or {}
    max_pixels = int(image.get("max_pixels") or size.get("longest_edge") or 0)
    if max_pixels <= 0:
        raise ValueError("Qwen2-VL processor config has no max_pixels / size.longest_edge")
    side = qwen2vl_side(max_pixels, patch, merge)
    grid = (1, side // patch, side // patch)
    return {
        "image_token_id": int(config["image_token_id"]),
        "tokens_per_image": grid[1] * grid[2] // (merge * merge),
        "image_size": (side, side),
        "vision_start_id": int(config["vision_start_token_id"]),
        "vision_end_id": int(config["vision_end_token_id"]),
        "image_grid_thw": grid,
        "spatial_merge_size": merge,
    }


def qwen2vl_side(max_pixels: int, patch: int, merge: int) -> int:
    """The fixed square side for Qwen2-VL: the largest multiple of patch*merge with
    side**2 <= max_pixels (the processor's smart_resize leaves such an image unchanged)."""
    unit = patch * merge
    side = math.isqrt(max_pixels) // unit * unit
    if side == 0:
        raise ValueError(f"max_pixels={max_pixels} is below one merged patch ({unit}x{unit})")
    return side


def _first(value: Any) -> int | None:
    """An HF token id field that may be an int, a list of ints or None."""
    if isinstance(value, list):
        value = value[0] if value else None
    return None if value is None else int(value)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not an HF model folder")
    return json.loads(path.read_text())


def _image_processor_config(root: Path) -> dict[str, Any]:
    """The image processor's settings: `preprocessor_config.json`, or the `image_processor`
    section of transformers 5's `processor_config.json`."""
    legacy = root / "preprocessor_config.json"
    if legacy.is_file():
        return _read_json(legacy)
    combined = root / "processor_config.json"
    if combined.is_file():
        return _read_json(combined).get("image_processor", {})
    return {}
