"""Load an HF model folder (LLaVA-1.5, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL, or a Llama/Qwen2 causal
LM) unchanged, as transformers does, on CPU or CUDA (reference runner, Serve encoder replica,
benchmarks, tests).

The folder is a local path or an S3 prefix (`s3://bucket/prefix?endpoint=host:port`, the store's
URL form, keys from MPIC_S3_ACCESS_KEY / MPIC_S3_SECRET_KEY): `resolve_model_dir` copies the
prefix's files once into `MPICHome().models_dir / "s3-<hash>"` (a file whose size already matches
is not fetched again) and the local copy is loaded.

Returns the model in eval mode and its processor (the tokenizer for a text-only model); the family
is read from config.json through `ModelSpec`, so the same call loads every family.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from mpic.model_spec import ModelSpec

logger = logging.getLogger(__name__)


def resolve_model_dir(path: str | os.PathLike[str], cache_root: Path | None = None) -> str:
    """A local folder for `path`: itself, or the local copy of an `s3://` prefix (downloaded
    into `cache_root`, default `MPICHome().models_dir`). FileNotFoundError for an empty prefix."""
    text = str(path)
    if not text.startswith("s3://"):
        return text
    from mpic.config import MPICHome
    from mpic.storage.factory import make_object_store
    from mpic.storage.object_store import check_key

    u = urlparse(text)
    name = hashlib.sha256(f"{u.netloc}/{u.path.strip('/')}".encode()).hexdigest()[:16]
    local = (cache_root or MPICHome().models_dir) / f"s3-{name}"
    store = make_object_store(text)
    try:
        keys = sorted(store.list(""))
        if not keys:
            raise FileNotFoundError(f"{u.netloc}/{u.path.strip('/')}: no model files under it")
        for key in keys:
            target = local / check_key(key)  # no '..': never written outside `local`
            size = store.stat(key).size
            if target.is_file() and target.stat().st_size == size:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.part")
            partial.write_bytes(store.get(key))
            partial.replace(target)
    finally:
        store.close()
    logger.info("model %s copied to %s", f"s3://{u.netloc}{u.path}", local)
    return str(local)


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
