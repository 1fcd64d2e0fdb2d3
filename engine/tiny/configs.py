"""Shapes, HF configs and processors of the tiny random models (CLI process, test processes).

`SHAPES` lists every (family, size) that `mpic model make-tiny` writes; docs/models.md explains
the choices (LLaVA-1.5-style fixed tokens per image, GQA, 144 tokens per image in `small`; `7b`:
the real LLaVA-1.5-7B and Qwen2-VL-7B shapes for GPU benchmarks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FAMILIES: tuple[str, ...] = ("llava", "qwen2-vl")
SIZES: tuple[str, ...] = ("tiny", "small", "7b")


@dataclass(frozen=True)
class TinyShape:
    """The shape of one generated model. The vision tower emits `tokens_per_image` tokens."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    image_size: int
    patch_size: int

    @property
    def head_dim(self) -> int:
        """Attention head size of the language model."""
        return self.hidden // self.heads


SHAPES: dict[tuple[str, str], TinyShape] = {
    # Text head size 32 in `tiny`: vLLM's CPU attention supports 32, 64, 80, ... only.
    # LLaVA: CLIP patches 32/8 -> 4x4 = 16 tokens; 336/28 -> 12x12 = 144 tokens.
    ("llava", "tiny"): TinyShape(128, 2, 4, 2, 256, 512, 2048, 32, 2, 2, 32, 8),
    ("llava", "small"): TinyShape(512, 8, 8, 2, 1408, 32000, 8192, 256, 4, 4, 336, 28),
    # Qwen2-VL: patches of 14, merged 2x2: 112/14 = 8 -> 4x4 = 16 tokens; 336/14 = 24 -> 144.
    ("qwen2-vl", "tiny"): TinyShape(128, 2, 4, 2, 256, 512, 2048, 32, 2, 2, 112, 14),
    ("qwen2-vl", "small"): TinyShape(512, 8, 8, 2, 1408, 32000, 8192, 128, 4, 4, 336, 14),
    # Real shapes for GPU benchmarks (random weights, written in bf16, ideally on a GPU).
    # LLaVA-1.5-7B: Vicuna-7B backbone (MHA 32/32, FFN 11008), CLIP ViT-L/14-336 -> 576 tokens.
    # Positions up to 16k so that 16 images (9.4k tokens) fit.
    ("llava", "7b"): TinyShape(4096, 32, 32, 32, 11008, 32000, 16384, 1024, 24, 16, 336, 14),
    # Qwen2-VL-7B: 3584 hidden, 28 layers, GQA 28/4, FFN 18944; ViT 1280 x 32 layers, 16 heads;
    # 336 px -> 24 x 24 patches merged 2x2 -> 144 tokens. Vocabulary 32k (real: 152k).
    ("qwen2-vl", "7b"): TinyShape(3584, 28, 28, 4, 18944, 32000, 32768, 1280, 32, 16, 336, 14),
}


def _text_fields(shape: TinyShape) -> dict[str, Any]:
    """The language-model fields both families share (untied LM head, as both real models)."""
    return {
        "vocab_size": shape.vocab,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "max_position_embeddings": shape.max_positions,
        "tie_word_embeddings": False,
    }


def llava_config(shape: TinyShape, token_ids: dict[str, int]) -> Any:
    """A LLaVA-1.5 config: Llama backbone with GQA, CLIP tower, 2-layer MLP projector."""
    from transformers import LlavaConfig

    return LlavaConfig(
        text_config={
            **_text_fields(shape),
            "model_type": "llama",
            "head_dim": shape.head_dim,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-5,
            "bos_token_id": token_ids["<s>"],
            "eos_token_id": token_ids["</s>"],
            "pad_token_id": token_ids["<pad>"],
        },
        vision_config={
            "model_type": "clip_vision_model",
            "hidden_size": shape.vision_hidden,
            "intermediate_size": 4 * shape.vision_hidden,
            "num_hidden_layers": shape.vision_layers,
            "num_attention_heads": shape.vision_heads,
            "image_size": shape.image_size,
            "patch_size": shape.patch_size,
            "projection_dim": shape.vision_hidden,
            "hidden_act": "quick_gelu",
        },
        image_token_index=token_ids["<image>"],
        image_seq_length=(shape.image_size // shape.patch_size) ** 2,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )


def qwen2vl_config(shape: TinyShape, token_ids: dict[str, int]) -> Any:
    """A Qwen2-VL config: M-RoPE backbone with GQA, ViT with a 2x2 patch merger."""
    from transformers import Qwen2VLConfig

    half = shape.head_dim // 2  # rotary frequency pairs, split (t, h, w) as Qwen2-VL's 16/24/24
    section = [half // 4, half * 3 // 8, half - half // 4 - half * 3 // 8]
    return Qwen2VLConfig(
        text_config={
            **_text_fields(shape),
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": section,
            },
            "bos_token_id": token_ids["<|endoftext|>"],
            "eos_token_id": token_ids["<|im_end|>"],
        },
        vision_config={
            "depth": shape.vision_layers,
            "embed_dim": shape.vision_hidden,
            "hidden_size": shape.hidden,
            "num_heads": shape.vision_heads,
            "mlp_ratio": 4,
            "patch_size": shape.patch_size,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def processor(family: str, shape: TinyShape, tokenizer: Any) -> Any:
    """The family's HF processor with an image processor that yields ONE fixed image size."""
    from mpic.engine.tiny.tokenizer import CHAT_TEMPLATES

    template = CHAT_TEMPLATES[family]
    side = shape.image_size
    if family == "llava":
        from transformers import CLIPImageProcessor, LlavaProcessor

        images = CLIPImageProcessor(
            size={"shortest_edge": side}, crop_size={"height": side, "width": side}
        )
        return LlavaProcessor(
            image_processor=images,
            tokenizer=tokenizer,
            patch_size=shape.patch_size,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
            chat_template=template,
        )
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    pixels = {"shortest_edge": side * side, "longest_edge": side * side}
    kwargs = {"size": pixels, "patch_size": shape.patch_size, "merge_size": 2}
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**kwargs, min_pixels=side**2, max_pixels=side**2),
        video_processor=Qwen2VLVideoProcessor(**kwargs),
        tokenizer=tokenizer,
        chat_template=template,
    )
