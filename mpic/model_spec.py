"""What the linker and engines need to know about a model folder (all processes).

`ModelSpec.from_pretrained(path)` reads an HF folder's config (through transformers' AutoConfig,
which fills the defaults real checkpoints leave out and upgrades legacy layouts), so the linker
can lay out prompts (placeholder ids, M-RoPE rules) and engines can size KV. docs/models.md lists
the prompt conventions.

There is no fixed tokens-per-image: each image gets the token count and (M-RoPE) grid its model's
own processor gives it (anyres tiles for LLaVA-NeXT, native resolution for Qwen2-VL/2.5-VL); a
cache entry records its own (`CacheEntry.num_tokens`, `extra["image_grid_thw"]`), and
`mpic.engine.hf.vision.image_layout(processor, image)` computes them for an image. The image
processor's settings are part of the fingerprint, so changing them (e.g. Qwen2-VL's max_pixels)
names every entry anew.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpic.addressing import model_fingerprint
from mpic.types import TEXT_FAMILIES, ModelFamily

_MODEL_TYPES: dict[str, ModelFamily] = {
    "llava": "llava",
    "llava_next": "llava-next",
    "qwen2_vl": "qwen2-vl",
    "qwen2_5_vl": "qwen2.5-vl",
    "llama": "llama",
    "qwen2": "qwen2",
}


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
    """Static facts about one model. Qwen2-VL-only fields are None for LLaVA; a text-only model
    (`llama`, `qwen2`) has no image fields (image_token_id None)."""

    family: ModelFamily
    path: str
    fingerprint: str
    """sha256 over the config, weight and image-processor config files: part of every cache
    entry's key."""
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_model_len: int
    rope: RopeSpec
    image_token_id: int | None
    """The placeholder id every image token carries in the prompt (None: a text-only model)."""
    model_type: str = ""
    """The HF `model_type` (llava, llava_next, qwen2_vl, qwen2_5_vl, ...)."""
    vision_start_id: int | None = None
    vision_end_id: int | None = None
    spatial_merge_size: int | None = None
    """Qwen2-VL/2.5-VL: patches merged per side into one token (an image's grid (t, h, w) is
    before the merge: T = t * h * w / merge**2)."""
    bos_token_id: int | None = None
    """Prepended to every prompt when not None (LLaVA/Llama); Qwen2-VL prompts have no BOS."""
    eos_token_id: int | None = None
    """Ends an assistant turn: `</s>` (LLaVA) or `<|im_end|>` (Qwen2-VL)."""
    eos_token_ids: tuple[int, ...] = ()
    """Every id that ends generation on both engines: the config's `eos_token_id` (int or
    list), the generation config's, and the tokenizer's end token (the chat template's turn end);
    `end_token_ids` falls back to `eos_token_id` when empty."""

    @property
    def end_token_ids(self) -> tuple[int, ...]:
        """The ids decoding stops at (EOS), unless a request or benchmark ignores EOS."""
        if self.eos_token_ids:
            return self.eos_token_ids
        return () if self.eos_token_id is None else (self.eos_token_id,)

    @property
    def takes_images(self) -> bool:
        """False for a text-only model (its items are documents only)."""
        return self.image_token_id is not None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> ModelSpec:
        """Read an HF model folder (LLaVA-1.5, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL, or a
        Llama/Qwen2 causal LM).

        Raises FileNotFoundError if the folder has no config.json and ValueError for an
        unsupported model type.
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
        text = config.get("text_config") or config
        heads = int(text["num_attention_heads"])
        rope = rope_spec(text)
        common: dict[str, Any] = {
            "family": family,
            "path": str(root),
            "fingerprint": _fingerprint(root),
            "model_type": str(config["model_type"]),
            "num_layers": int(text["num_hidden_layers"]),
            "num_heads": heads,
            "num_kv_heads": int(text.get("num_key_value_heads") or heads),
            "head_dim": rope.head_dim,
            "hidden_size": int(text["hidden_size"]),
            "vocab_size": int(text["vocab_size"]),
            "max_model_len": int(text["max_position_embeddings"]),
            "rope": rope,
            "eos_token_id": _first(text.get("eos_token_id")),
            "eos_token_ids": _end_ids(root, text.get("eos_token_id")),
        }
        if family in TEXT_FAMILIES:
            return cls(
                **common,
                image_token_id=None,
                bos_token_id=_first(text.get("bos_token_id")),
            )
        if family in ("llava", "llava-next"):
            return cls(**common, **_llava_fields(config))
        return cls(**common, **_qwen2vl_fields(config))


def rope_spec(text: dict[str, Any]) -> RopeSpec:
    """The RoPE of an HF text config (as a dict): head size, theta and the M-RoPE section."""
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", text.get("rope_theta", 10000.0)))
    section = params.get("mrope_section")
    return RopeSpec(head_dim, theta, tuple(int(x) for x in section) if section else None)


def _llava_fields(config: dict[str, Any]) -> dict[str, Any]:
    """LLaVA-1.5 / LLaVA-NeXT: one placeholder id, BOS from the text config."""
    return {
        "image_token_id": int(
            config["image_token_index"]
            if config.get("image_token_index") is not None
            else config["image_token_id"]
        ),
        "bos_token_id": _first(config["text_config"].get("bos_token_id")),
    }


def _qwen2vl_fields(config: dict[str, Any]) -> dict[str, Any]:
    """Qwen2-VL / Qwen2.5-VL: placeholder, vision start/end ids and the spatial merge."""
    return {
        "image_token_id": int(config["image_token_id"]),
        "vision_start_id": int(config["vision_start_token_id"]),
        "vision_end_id": int(config["vision_end_token_id"]),
        "spatial_merge_size": int(config["vision_config"]["spatial_merge_size"]),
    }


def _fingerprint(root: Path) -> str:
    """The checkpoint's fingerprint (`model_fingerprint`), extended by the image processor's
    config when the folder has one: the processed pixels, hence every entry, depend on it."""
    base = model_fingerprint(root)
    image = _image_processor_config(root)
    if not image:
        return base
    canon = json.dumps(image, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"{base}\0{canon}".encode()).hexdigest()


def _first(value: Any) -> int | None:
    """An HF token id field that may be an int, a list of ints or None."""
    if isinstance(value, list):
        value = value[0] if value else None
    return None if value is None else int(value)


def _ids(value: Any) -> list[int]:
    """An HF token id field (int, list of ints or None) as a list."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _end_ids(root: Path, config_eos: Any) -> tuple[int, ...]:
    """End-of-sequence ids, in order and unique: the config's, `generation_config.json`'s, and
    the tokenizer's `eos_token` (looked up among `tokenizer.json`'s added tokens)."""
    ids = _ids(config_eos)
    generation = root / "generation_config.json"
    if generation.is_file():
        ids += _ids(_read_json(generation).get("eos_token_id"))
    tok_cfg, tok = root / "tokenizer_config.json", root / "tokenizer.json"
    if tok_cfg.is_file() and tok.is_file():
        eos = _read_json(tok_cfg).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        for added in _read_json(tok).get("added_tokens", []):
            if eos is not None and added.get("content") == eos:
                ids.append(int(added["id"]))
    return tuple(dict.fromkeys(ids))


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
