"""Tokens per image with the REAL 7B checkpoints' processor configs (llava-hf/llava-1.5-7b-hf,
llava-hf/llava-v1.6-mistral-7b-hf, Qwen/Qwen2-VL-7B-Instruct, Qwen/Qwen2.5-VL-7B-Instruct),
written offline by the tiny writer (`engine/tiny/configs.py` REAL_PREPROCESSOR_CONFIGS) and read
back by transformers' AutoProcessor: `vision.image_layout` equals the placeholder tokens the
processor's own call expands to, for a 336x336, a 1024x768 and a 2048x1536 image
(docs/checkpoints.md has the table)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from mpic.engine.hf.vision import image_layout
from mpic.engine.tiny.configs import REAL_PREPROCESSOR_CONFIGS, SHAPES, processor
from mpic.engine.tiny.tokenizer import build_tokenizer

IMAGE_SIZES = [(336, 336), (1024, 768), (2048, 1536)]  # (width, height)
EXPECTED = {
    "llava": [576, 576, 576],
    "llava-next": [1176, 2340, 2340],
    "qwen2-vl": [144, 999, 4015],
    "qwen2.5-vl": [144, 999, 4015],
}
GRIDS = [(1, 24, 24), (1, 54, 74), (1, 110, 146)]


def _real_folder(family: str, root: Path) -> Path:
    """A folder laid out as the real checkpoint's: its preprocessor_config.json verbatim, the
    LLaVA processors' processor_config.json, a tokenizer and chat template (ours)."""
    tokenizer = build_tokenizer(family, 600)  # type: ignore[arg-type]
    processor(family, SHAPES[(family, "7b")], tokenizer, "7b").save_pretrained(root)
    real = REAL_PREPROCESSOR_CONFIGS[family]
    (root / "preprocessor_config.json").write_text(json.dumps(real, indent=2))
    combined = root / "processor_config.json"
    if combined.exists():
        data = json.loads(combined.read_text())
        data.pop("image_processor", None)
        data.pop("video_processor", None)
        data["processor_class"] = real["processor_class"]
        combined.write_text(json.dumps(data, indent=2))
    return root


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_tokens_per_image_match_the_real_processor(family: str, tmp_path: Path):
    from transformers import AutoProcessor

    loaded = AutoProcessor.from_pretrained(_real_folder(family, tmp_path))
    assert type(loaded).__name__ == REAL_PREPROCESSOR_CONFIGS[family]["processor_class"]
    tokenizer = loaded.tokenizer
    image_id = tokenizer.convert_tokens_to_ids(loaded.image_token)
    text = loaded.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}]}], add_generation_prompt=True
    )
    counts = []
    for (w, h), grid in zip(IMAGE_SIZES, GRIDS, strict=True):
        image = Image.new("RGB", (w, h), (90, 120, 200))
        ids = loaded(text=text, images=[image], return_tensors="pt")["input_ids"][0]
        layout = image_layout(loaded, image)
        assert layout.num_tokens == int((ids == image_id).sum())
        assert layout.grid_thw == (grid if family.startswith("qwen") else None)
        counts.append(layout.num_tokens)
    assert counts == EXPECTED[family]
