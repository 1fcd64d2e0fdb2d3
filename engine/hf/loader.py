"""Load an HF model folder (LLaVA-1.5, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL, or a Llama/Qwen2 causal
LM) unchanged, as transformers does, on CPU or CUDA (reference runner, Serve encoder replica,
benchmarks, tests).

The folder is a local path or an S3 prefix (`s3://bucket/prefix?endpoint=host:port`, the store's
URL form, keys from MPIC_S3_ACCESS_KEY / MPIC_S3_SECRET_KEY): `resolve_model_dir`
(`mpic.engine.model_dir`, shared with the vLLM engine; re-exported here) copies the prefix's files
once into `MPICHome().models_dir / "s3-<hash>"` and the local copy is loaded.

Returns the model in eval mode and its processor (the tokenizer for a text-only model); the family
is read from config.json through `ModelSpec`, so the same call loads every family.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from mpic.engine.model_dir import resolve_model_dir
from mpic.model_spec import ModelSpec

__all__ = ["load_hf_model", "resolve_model_dir"]

logger = logging.getLogger(__name__)


def load_hf_model(
    path: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[Any, Any, ModelSpec]:
    """(model, processor, spec) for the folder at `path`, weights in `dtype` on `device`.

    Attention runs through torch SDPA. Raises FileNotFoundError / ValueError (via ModelSpec) for
    a folder that is not a supported HF model.
    """
    from transformers import (
        AutoModelForCausalLM,
        AutoProcessor,
        AutoTokenizer,
        LlavaForConditionalGeneration,
        LlavaNextForConditionalGeneration,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
    )

    spec = ModelSpec.from_pretrained(resolve_model_dir(path))
    model_cls: Any = {
        "llava": LlavaForConditionalGeneration,
        "llava-next": LlavaNextForConditionalGeneration,
        "qwen2-vl": Qwen2VLForConditionalGeneration,
        "qwen2.5-vl": Qwen2_5_VLForConditionalGeneration,
    }.get(spec.family)
    if not spec.takes_images:  # a text-only Llama/Qwen2 causal LM
        model_cls = AutoModelForCausalLM
    model = model_cls.from_pretrained(spec.path, dtype=dtype, attn_implementation="sdpa")
    model = model.to(torch.device(device)).eval()
    processor = (
        AutoProcessor.from_pretrained(spec.path)
        if spec.takes_images
        else AutoTokenizer.from_pretrained(spec.path)
    )
    logger.info("loaded %s model %s on %s (%s)", spec.family, spec.path, device, dtype)
    return model, processor, spec
