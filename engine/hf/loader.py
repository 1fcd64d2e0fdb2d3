"""Load an HF model folder (LLaVA-1.5-style or Qwen2-VL) with transformers on CPU or CUDA
(reference runner, Serve encoder replica, benchmarks, tests).

Returns the model in eval mode and its processor; the family is read from config.json through
`ModelSpec`, so the same call loads both families.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from mpic.model_spec import ModelSpec

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
        AutoProcessor,
        LlavaForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
    )

    spec = ModelSpec.from_pretrained(path)
    model_cls: Any = (
        LlavaForConditionalGeneration if spec.family == "llava" else Qwen2VLForConditionalGeneration
    )
    model = model_cls.from_pretrained(spec.path, dtype=dtype, attn_implementation="sdpa")
    model = model.to(torch.device(device)).eval()
    processor = AutoProcessor.from_pretrained(spec.path)
    logger.info("loaded %s model %s on %s (%s)", spec.family, spec.path, device, dtype)
    return model, processor, spec
