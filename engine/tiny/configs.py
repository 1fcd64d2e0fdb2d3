"""Shapes, HF configs and processors of the tiny random models (CLI process, test processes).

`SHAPES` lists every (family, size) that `mpic model make-tiny` writes; docs/models.md explains
the choices (GQA, 144 tokens per 336-px image in `small`; `7b`: the real LLaVA-1.5-7B,
LLaVA-1.6-Mistral-7B, Qwen2-VL-7B and Qwen2.5-VL-7B shapes for GPU benchmarks).

Image processors are the families' own transformers classes: LLaVA-NeXT tiles images by "anyres"
over `image_grid_pinpoints` (the real checkpoint's five grids, scaled to the tower's image size),
Qwen2-VL/2.5-VL keep each image's native resolution within [min_pixels, max_pixels]. `7b` writes
the real checkpoints' processor configs (`REAL_PREPROCESSOR_CONFIGS`, their public
preprocessor_config.json values), so token counts per image are the real models'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FAMILIES: tuple[str, ...] = ("llava", "llava-next", "qwen2-vl", "qwen2.5-vl")
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
    # LLaVA-NeXT: the LLaVA towers; anyres tiles of image_size (base image + up to 3 tiles).
    ("llava-next", "tiny"): TinyShape(128, 2, 4, 2, 256, 512, 4096, 32, 2, 2, 32, 8),
    ("llava-next", "small"): TinyShape(512, 8, 8, 2, 1408, 32000, 16384, 256, 4, 4, 336, 28),
    # LLaVA-1.6-Mistral-7B: Mistral-7B backbone (GQA 32/8, FFN 14336), CLIP ViT-L/14-336.
    ("llava-next", "7b"): TinyShape(4096, 32, 32, 8, 14336, 32000, 32768, 1024, 24, 16, 336, 14),
    # Qwen2.5-VL: the Qwen2-VL shapes; ViT with window attention and an MLP merger.
    ("qwen2.5-vl", "tiny"): TinyShape(128, 2, 4, 2, 256, 512, 4096, 32, 2, 2, 112, 14),
    ("qwen2.5-vl", "small"): TinyShape(512, 8, 8, 2, 1408, 32000, 16384, 128, 4, 4, 336, 14),
    # Qwen2.5-VL-7B: 3584 hidden, 28 layers, GQA 28/4, FFN 18944; ViT 1280 x 32 layers, FFN 3420.
    ("qwen2.5-vl", "7b"): TinyShape(3584, 28, 28, 4, 18944, 32000, 32768, 1280, 32, 16, 336, 14),
}

_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
REAL_PREPROCESSOR_CONFIGS: dict[str, dict[str, Any]] = {
    # llava-hf/llava-1.5-7b-hf
    "llava": {
        "crop_size": {"height": 336, "width": 336},
        "do_center_crop": True,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": _CLIP_MEAN,
        "image_processor_type": "CLIPImageProcessor",
        "image_std": _CLIP_STD,
        "processor_class": "LlavaProcessor",
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "size": {"shortest_edge": 336},
    },
    # llava-hf/llava-v1.6-mistral-7b-hf
    "llava-next": {
        "aspect_ratio_setting": "anyres",
        "crop_size": {"height": 336, "width": 336},
        "do_center_crop": True,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
        "image_mean": _CLIP_MEAN,
        "image_processor_type": "LlavaNextImageProcessor",
        "image_std": _CLIP_STD,
        "processor_class": "LlavaNextProcessor",
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "size": {"shortest_edge": 336},
    },
    # Qwen/Qwen2-VL-7B-Instruct
    "qwen2-vl": {
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": _CLIP_MEAN,
        "image_std": _CLIP_STD,
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
    },
}
# Qwen/Qwen2.5-VL-7B-Instruct: the Qwen2-VL image processor and values, its own processor class.
REAL_PREPROCESSOR_CONFIGS["qwen2.5-vl"] = {
    **REAL_PREPROCESSOR_CONFIGS["qwen2-vl"],
    "processor_class": "Qwen2_5_VLProcessor",
}
"""The public preprocessor_config.json of each family's 7B checkpoint (written by `--size 7b`)."""

QWEN_PIXELS: dict[str, tuple[int, int]] = {
    "tiny": (56 * 56, 224 * 224),
    "small": (56 * 56, 448 * 448),
    "7b": (3136, 12845056),
}
"""(min_pixels, max_pixels) of the Qwen processors per size (`7b`: the real checkpoints')."""


def grid_pinpoints(side: int) -> list[list[int]]:
    """LLaVA-1.6's anyres grids (1x2, 2x1, 2x2, 3x1, 1x3 tiles) for tiles of `side` pixels."""
    return [[side * h, side * w] for h, w in ((1, 2), (2, 1), (2, 2), (3, 1), (1, 3))]


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


def llava_next_config(shape: TinyShape, token_ids: dict[str, int]) -> Any:
    """A LLaVA-NeXT (1.6) config: Mistral backbone with GQA, CLIP tower, anyres tiles, image
    newline embedding, 2-layer MLP projector."""
    from transformers import LlavaNextConfig

    base = llava_config(shape, token_ids).to_dict()
    text = {
        **_text_fields(shape),
        "model_type": "mistral",
        "head_dim": shape.head_dim,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-5,
        "sliding_window": None,
        "bos_token_id": token_ids["<s>"],
        "eos_token_id": token_ids["</s>"],
        "pad_token_id": token_ids["<pad>"],
    }
    return LlavaNextConfig(
        text_config=text,
        vision_config=base["vision_config"],
        image_token_index=token_ids["<image>"],
        image_seq_length=base["image_seq_length"],
        image_grid_pinpoints=grid_pinpoints(shape.image_size),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )


def qwen25vl_config(shape: TinyShape, token_ids: dict[str, int]) -> Any:
    """A Qwen2.5-VL config: the Qwen2-VL backbone; ViT with RMSNorm, SwiGLU, window attention
    (windows of 112 px; full attention in the last block of every quarter) and an MLP merger."""
    from transformers import Qwen2_5_VLConfig

    qwen2 = qwen2vl_config(shape, token_ids).to_dict()
    depth = shape.vision_layers
    full = sorted({depth // 4 * (i + 1) - 1 for i in range(4)} - {-1}) or [depth - 1]
    return Qwen2_5_VLConfig(
        text_config=qwen2["text_config"],
        vision_config={
            "depth": depth,
            "hidden_size": shape.vision_hidden,
            "intermediate_size": 3420 if shape.vision_hidden == 1280 else 2 * shape.vision_hidden,
            "num_heads": shape.vision_heads,
            "out_hidden_size": shape.hidden,
            "patch_size": shape.patch_size,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": full,
            "hidden_act": "silu",
        },
        image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def _image_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in ("image_processor_type", "processor_class")}


def image_processor(family: str, shape: TinyShape, size: str = "tiny") -> Any:
    """The family's own transformers image processor for a model of `shape` (`7b`: the real
    checkpoint's settings, `REAL_PREPROCESSOR_CONFIGS`)."""
    from transformers import CLIPImageProcessor, LlavaNextImageProcessor, Qwen2VLImageProcessor

    side = shape.image_size
    if size == "7b":
        kwargs = _image_kwargs(REAL_PREPROCESSOR_CONFIGS[family])
        kwargs.pop("aspect_ratio_setting", None)
        cls = {"llava": CLIPImageProcessor, "llava-next": LlavaNextImageProcessor}
        return cls.get(family, Qwen2VLImageProcessor)(**kwargs)
    if family == "llava":
        return CLIPImageProcessor(
            size={"shortest_edge": side}, crop_size={"height": side, "width": side}
        )
    if family == "llava-next":
        return LlavaNextImageProcessor(
            size={"shortest_edge": side},
            crop_size={"height": side, "width": side},
            image_grid_pinpoints=grid_pinpoints(side),
        )
    low, high = QWEN_PIXELS[size]
    return Qwen2VLImageProcessor(
        size={"shortest_edge": low, "longest_edge": high},
        min_pixels=low,
        max_pixels=high,
        patch_size=shape.patch_size,
        merge_size=2,
    )


def processor(family: str, shape: TinyShape, tokenizer: Any, size: str = "tiny") -> Any:
    """The family's HF processor (`AutoProcessor` class) with its own image processor."""
    from mpic.engine.tiny.tokenizer import CHAT_TEMPLATES

    template = CHAT_TEMPLATES[family]
    images = image_processor(family, shape, size)
    if family in ("llava", "llava-next"):
        from transformers import LlavaNextProcessor, LlavaProcessor

        cls = LlavaProcessor if family == "llava" else LlavaNextProcessor
        return cls(
            image_processor=images,
            tokenizer=tokenizer,
            patch_size=shape.patch_size,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
            chat_template=template,
        )
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    cls = Qwen2VLProcessor if family == "qwen2-vl" else Qwen2_5_VLProcessor
    video = {"size": dict(images.size), "patch_size": shape.patch_size, "merge_size": 2}
    return cls(
        image_processor=images,
        video_processor=Qwen2VLVideoProcessor(**video),
        tokenizer=tokenizer,
        chat_template=template,
    )
