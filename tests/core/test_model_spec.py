"""mpic/model_spec.py on the configs of real checkpoints (legacy layouts, defaults left out):
the folder needs no weights, only config.json and the image processor config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mpic.model_spec import ModelSpec

# llava-hf/llava-1.5-7b-hf: text_config omits Llama defaults (hidden 4096, 32 layers/heads).
LLAVA_15_7B = {
    "architectures": ["LlavaForConditionalGeneration"],
    "image_token_index": 32000,
    "model_type": "llava",
    "pad_token_id": 32001,
    "projector_hidden_act": "gelu",
    "text_config": {
        "max_position_embeddings": 4096,
        "model_type": "llama",
        "rms_norm_eps": 1e-05,
        "vocab_size": 32064,
    },
    "vision_config": {
        "hidden_size": 1024,
        "image_size": 336,
        "intermediate_size": 4096,
        "model_type": "clip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "patch_size": 14,
        "projection_dim": 768,
    },
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
}
CLIP_336 = {
    "crop_size": {"height": 336, "width": 336},
    "do_center_crop": True,
    "image_processor_type": "CLIPImageProcessor",
    "size": {"shortest_edge": 336},
}
# Qwen/Qwen2-VL-7B-Instruct (transformers 4.x layout: text fields at the top, rope_scaling).
QWEN2VL_7B = {
    "architectures": ["Qwen2VLForConditionalGeneration"],
    "model_type": "qwen2_vl",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rope_theta": 1000000.0,
    "vocab_size": 152064,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {
        "depth": 32,
        "embed_dim": 1280,
        "num_heads": 16,
        "hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
}
QWEN2VL_448 = {
    "min_pixels": 448 * 448,
    "max_pixels": 448 * 448,
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "image_processor_type": "Qwen2VLImageProcessor",
}


def _folder(root: Path, config: dict, processor: dict) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    (root / "preprocessor_config.json").write_text(json.dumps(processor))
    return root


def test_llava_15_7b_config(tmp_path: Path):
    spec = ModelSpec.from_pretrained(_folder(tmp_path / "llava", LLAVA_15_7B, CLIP_336))
    assert spec.family == "llava"
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (32, 32, 32, 128)
    assert (spec.hidden_size, spec.vocab_size, spec.max_model_len) == (4096, 32064, 4096)
    assert spec.rope.theta == 10000.0 and spec.rope.mrope_section is None
    assert spec.image_token_id == 32000 and spec.model_type == "llava"
    assert (spec.bos_token_id, spec.eos_token_id) == (1, 2)
    assert spec.spatial_merge_size is None and spec.vision_start_id is None


def test_qwen2vl_7b_config_with_a_fixed_448_image(tmp_path: Path):
    spec = ModelSpec.from_pretrained(_folder(tmp_path / "qwen", QWEN2VL_7B, QWEN2VL_448))
    assert spec.family == "qwen2-vl"
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (28, 28, 4, 128)
    assert spec.rope.theta == 1e6 and spec.rope.mrope_section == (16, 24, 24)
    assert spec.spatial_merge_size == 2 and spec.model_type == "qwen2_vl"
    assert (spec.vision_start_id, spec.image_token_id, spec.vision_end_id) == (
        151652,
        151655,
        151653,
    )
    assert spec.bos_token_id is None and spec.eos_token_id == 151645


def test_spec_rejects_non_models(tmp_path: Path):
    with pytest.raises(FileNotFoundError):
        ModelSpec.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="not supported"):
        ModelSpec.from_pretrained(tmp_path)
