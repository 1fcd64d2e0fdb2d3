"""engine/tiny/models.py and mpic/model_spec.py: the written folders load in transformers, are
deterministic, and ModelSpec reads the facts the processor actually applies."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from mpic.addressing import model_fingerprint as fingerprint
from mpic.cli import app
from mpic.engine.hf.vision import image_layout
from mpic.engine.tiny.configs import SHAPES
from mpic.engine.tiny.models import make_tiny
from mpic.model_spec import ModelSpec
from mpic.types import MROPE_FAMILIES


def test_folder_loads_in_transformers(tiny_model_dir: Path, model_family: str):
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert config.architectures[0] in (
        "LlavaForConditionalGeneration",
        "LlavaNextForConditionalGeneration",
        "Qwen2VLForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tokenizer) == config.text_config.vocab_size
    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    assert processor.chat_template
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as handle:
        keys = list(handle.keys())
    if model_family in ("llava", "llava-next"):  # vLLM's layout (transformers maps it back)
        assert any(k.startswith("model.vision_tower.vision_model.embeddings.") for k in keys)
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
        bos = config.text_config.bos_token_id
        for special in (True, False):  # exactly one BOS, from the template
            ids = tokenizer(rendered, add_special_tokens=special).input_ids
            assert ids[0] == bos and bos not in ids[1:]


def test_chat_template_uses_the_system_prompt(tiny_model_dir: Path):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q?"}]}
    custom = processor.apply_chat_template(
        [{"role": "system", "content": "Be terse."}, user], add_generation_prompt=True
    )
    default = processor.apply_chat_template([user], add_generation_prompt=True)
    assert "Be terse." in custom and "Be terse." not in default
    assert custom.count(processor.image_token) == 1
    assert custom.rstrip().endswith(("ASSISTANT:", "<|im_start|>assistant"))


def test_hf_model_loads_every_weight(tiny_model_dir: Path):
    from transformers import (
        AutoConfig,
        LlavaForConditionalGeneration,
        LlavaNextForConditionalGeneration,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
    )

    config = AutoConfig.from_pretrained(tiny_model_dir)
    cls = {
        "llava": LlavaForConditionalGeneration,
        "llava_next": LlavaNextForConditionalGeneration,
        "qwen2_vl": Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
    }
    _, info = cls[config.model_type].from_pretrained(tiny_model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]


def test_spec_matches_what_the_processor_does(tiny_hf, sample_images):
    model, processor, spec = tiny_hf
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}],
        add_generation_prompt=True,
    )
    for image in sample_images:
        inputs = processor(text=text, images=[image], return_tensors="pt")
        ids = inputs["input_ids"][0]
        layout = image_layout(processor, image)
        assert int((ids == spec.image_token_id).sum()) == layout.num_tokens
        if spec.family in MROPE_FAMILIES:
            assert tuple(inputs["image_grid_thw"][0].tolist()) == layout.grid_thw
            image_at = int((ids == spec.image_token_id).nonzero()[0])
            assert ids[image_at - 1] == spec.vision_start_id
            assert ids[image_at + layout.num_tokens] == spec.vision_end_id
        else:
            assert ids[0] == spec.bos_token_id
    text_config = model.config.text_config
    assert spec.num_layers == text_config.num_hidden_layers
    assert spec.num_kv_heads < spec.num_heads  # GQA
    assert spec.hidden_size == model.lm_head.in_features
    assert spec.vocab_size == model.lm_head.out_features
    assert spec.image_token_id == model.config.image_token_id
    if spec.family in MROPE_FAMILIES:
        assert sum(spec.rope.mrope_section) == spec.head_dim // 2


def test_make_tiny_is_deterministic_and_seeded(tmp_path: Path, tiny_llava_dir: Path):
    again = make_tiny("llava", "tiny", tmp_path / "again")
    other = make_tiny("llava", "tiny", tmp_path / "other", seed=1)
    assert fingerprint(again) == fingerprint(tiny_llava_dir)
    assert fingerprint(other) != fingerprint(tiny_llava_dir)
    spec_fp = ModelSpec.from_pretrained(again).fingerprint  # also covers the image processor
    assert spec_fp == ModelSpec.from_pretrained(tiny_llava_dir).fingerprint


def test_fingerprint_follows_the_weights(tmp_path: Path, tiny_qwen2vl_dir: Path):
    import shutil

    copy = Path(shutil.copytree(tiny_qwen2vl_dir, tmp_path / "copy"))
    assert fingerprint(copy) == fingerprint(tiny_qwen2vl_dir)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert fingerprint(copy) != fingerprint(tiny_qwen2vl_dir)


def test_small_shapes_are_realistic():
    for family in ("llava", "qwen2-vl"):
        shape = SHAPES[(family, "small")]
        assert shape.layers >= 8 and shape.hidden >= 512 and shape.vocab >= 8000
        assert shape.heads == 8 and shape.kv_heads == 2
        assert shape.head_dim in (32, 64, 80, 96, 128)  # vLLM CPU attention head sizes
        per_image = (shape.image_size // shape.patch_size) ** 2 // (4 if family != "llava" else 1)
        assert per_image == 144
        assert 8 * per_image + 512 <= shape.max_positions


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--family", "gpt", "--out", "X"], "unknown --family"),
        (["--family", "llava", "--size", "huge", "--out", "X"], "unknown --size"),
    ],
)
def test_cli_rejects_bad_input(tmp_path: Path, args, message):
    args = [a if a != "X" else str(tmp_path / "m") for a in args]
    result = CliRunner().invoke(app, ["model", "make-tiny", *args])
    assert result.exit_code == 2
    assert message in result.output
    assert not (tmp_path / "m").exists()


def test_cli_writes_a_model_and_refuses_to_overwrite(tmp_path: Path):
    out = tmp_path / "m"
    ok = CliRunner().invoke(app, ["model", "make-tiny", "--family", "qwen2-vl", "--out", str(out)])
    assert ok.exit_code == 0, ok.output
    assert ModelSpec.from_pretrained(out).family == "qwen2-vl"
    again = CliRunner().invoke(app, ["model", "make-tiny", "--family", "llava", "--out", str(out)])
    assert again.exit_code == 2
    assert "not empty" in again.output
    assert ModelSpec.from_pretrained(out).family == "qwen2-vl"
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no staging folder left behind


def test_random_weights_are_not_degenerate(tiny_hf):
    model, _, spec = tiny_hf
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.no_grad():
        probs = model(input_ids=ids).logits[0, -1].float().softmax(-1)
    assert torch.isfinite(probs).all()
    assert 1.5 / spec.vocab_size < probs.max() < 0.9


def test_make_tiny_rejects_unknown_names(tmp_path: Path):
    with pytest.raises(ValueError, match="family must be one of"):
        make_tiny("gpt", "tiny", tmp_path / "m")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="size one of"):
        make_tiny("llava", "huge", tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_layers_sets_the_language_model_depth(tmp_path: Path):
    """`--layers`: the size's shape at another depth; the folder loads and its decoder has that
    many layers (weights included); bad values and `--lm` beside it are CLI errors."""
    from transformers import AutoConfig, LlavaForConditionalGeneration

    result = CliRunner().invoke(
        app,
        ["model", "make-tiny", "--family", "llava", "--layers", "3", "--out", str(tmp_path / "m")],
    )
    assert result.exit_code == 0, result.output
    config = AutoConfig.from_pretrained(tmp_path / "m")
    assert config.text_config.num_hidden_layers == 3 != SHAPES[("llava", "tiny")].layers
    model = LlavaForConditionalGeneration.from_pretrained(tmp_path / "m")
    assert len(model.model.language_model.layers) == 3
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as handle:
        assert any(".layers.2." in k and "language_model" in k for k in handle.keys())
    for bad in (["--layers", "0"], ["--layers", "2", "--lm", "smollm2"]):
        out = tmp_path / f"bad{len(bad)}"
        result = CliRunner().invoke(
            app, ["model", "make-tiny", "--family", "llava", *bad, "--out", str(out)]
        )
        assert result.exit_code == 2 and "error:" in result.output, result.output
        assert not out.exists()


def test_patch_size_sets_the_tokens_per_image(tmp_path: Path):
    """`--patch-size`: the vision tower's patch side, so tokens per image (image side / patch)^2
    (LLaVA-1.5's 576 at `small`'s 336 px and 14 px patches); the processor expands an image to
    that many tokens, and the model's forward fills them (transformers checks the counts). A
    patch that does not tile the image (for Qwen, into an even grid) is a CLI error that writes
    nothing."""
    import torch
    from PIL import Image
    from transformers import AutoConfig, AutoProcessor, LlavaForConditionalGeneration

    out = tmp_path / "m"
    args = ["model", "make-tiny", "--family", "llava", "--patch-size", "4", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    side = SHAPES[("llava", "tiny")].image_size
    tokens = (side // 4) ** 2
    assert tokens != (side // SHAPES[("llava", "tiny")].patch_size) ** 2
    assert AutoConfig.from_pretrained(out).image_seq_length == tokens
    processor = AutoProcessor.from_pretrained(out)
    inputs = processor(text="<image> hi", images=Image.new("RGB", (40, 30)), return_tensors="pt")
    image_id = AutoConfig.from_pretrained(out).image_token_index
    assert int((inputs["input_ids"] == image_id).sum()) == tokens
    model = LlavaForConditionalGeneration.from_pretrained(out)
    with torch.no_grad():  # transformers checks the image's features fill its tokens
        logits = model(**inputs).logits
    assert logits.shape[1] == inputs["input_ids"].shape[1]
    for family, bad in (("llava", "5"), ("qwen2-vl", "16"), ("llava", "0")):
        target = tmp_path / f"bad-{family}-{bad}"
        result = CliRunner().invoke(
            app,
            ["model", "make-tiny", "--family", family, "--patch-size", bad, "--out", str(target)],
        )
        assert result.exit_code == 2 and "patch size" in result.output, result.output
        assert not target.exists()
