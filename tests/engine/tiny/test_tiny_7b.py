"""The `7b` random models have the real shapes (LLaVA-1.5-7B with 576 tokens per image, Qwen2-VL-7B
with 144): built on the meta device (no memory), parameters counted. Writing one needs a GPU host
(~15 GB of bf16 weights); the CLI refuses a CUDA device that is not there."""

import pytest
import torch
from typer.testing import CliRunner

from mpic.cli import app
from mpic.engine.tiny.configs import SHAPES, llava_config, qwen2vl_config


def _params(family: str) -> tuple[int, int]:
    from transformers import LlavaForConditionalGeneration, Qwen2VLForConditionalGeneration

    shape = SHAPES[(family, "7b")]
    ids = {
        name: i
        for i, name in enumerate(
            ["<s>", "</s>", "<pad>", "<image>", "<|endoftext|>", "<|im_end|>", "<|image_pad|>"]
            + ["<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
        )
    }
    if family == "llava":
        config, cls = llava_config(shape, ids), LlavaForConditionalGeneration
    else:
        config, cls = qwen2vl_config(shape, ids), Qwen2VLForConditionalGeneration
    with torch.device("meta"):
        model = cls(config)
    text = sum(p.numel() for n, p in model.named_parameters() if "language_model" in n)
    return sum(p.numel() for p in model.parameters()), text


@pytest.mark.parametrize(
    ("family", "per_image", "total"),
    [("llava", 576, 7.06e9), ("qwen2-vl", 144, 7.43e9)],  # Qwen2-VL-7B: 8.29e9 with 152k vocab
)
def test_7b_shapes_are_the_real_ones(family, per_image, total):
    shape = SHAPES[(family, "7b")]
    assert shape.head_dim == 128
    patches = (shape.image_size // shape.patch_size) ** 2
    assert patches // (1 if family == "llava" else 4) == per_image
    assert 16 * per_image + 512 <= shape.max_positions  # the 16-image benchmark point fits
    count, _ = _params(family)
    assert abs(count - total) / total < 0.02, count


def test_cuda_device_without_a_gpu_is_a_cli_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    args = ["model", "make-tiny", "--family", "llava", "--size", "7b", "--device", "cuda"]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "m")])
    assert result.exit_code == 2 and "no CUDA" in result.output
    result = CliRunner().invoke(
        app, ["model", "make-tiny", "--family", "llava", "--dtype", "int8", "--out", str(tmp_path)]
    )
    assert result.exit_code == 2 and "unknown dtype" in result.output
