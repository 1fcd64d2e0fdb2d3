"""engine/hf/vision.py: image decoding errors, the processor's own token counts and grids, and
embeddings equal to what the HF model inserts at the image placeholders (images of three sizes)."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from mpic.engine.hf.vision import encode, encode_images, image_layout, load_image
from mpic.errors import UnreadableMediaError


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_load_image_round_trip(sample_images):
    decoded = load_image(_png(sample_images[1].convert("L")))
    assert decoded.mode == "RGB"
    assert decoded.size == sample_images[1].size


@pytest.mark.parametrize(
    "data", [b"", b"definitely not an image", b"\x89PNG\r\n\x1a\n" + b"\0" * 40], ids=str
)
def test_load_image_rejects_non_images(data):
    with pytest.raises(UnreadableMediaError) as info:
        load_image(data)
    assert info.value.status == 415


def test_load_image_rejects_truncated_image(sample_images):
    data = _png(sample_images[0])
    with pytest.raises(UnreadableMediaError):
        load_image(data[: len(data) // 2])


def test_image_layout_is_the_processors(tiny_hf, sample_images):
    """T per image = the placeholder tokens the processor's own call expands to; grids are the
    image processor's."""
    _, processor, spec = tiny_hf
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}]}], add_generation_prompt=True
    )
    for image in sample_images:
        inputs = processor(text=text, images=[image], return_tensors="pt")
        layout = image_layout(processor, image)
        assert int((inputs["input_ids"][0] == spec.image_token_id).sum()) == layout.num_tokens
        if "image_grid_thw" in inputs:
            assert tuple(inputs["image_grid_thw"][0].tolist()) == layout.grid_thw
        else:
            assert layout.grid_thw is None


def test_encode_images_equal_hf_inputs_embeds(tiny_hf, sample_images):
    """Capture the inputs_embeds the HF forward hands to its language model and compare the
    rows at the image placeholders with encode_images (three images of different sizes)."""
    model, processor, spec = tiny_hf
    content = [
        {"type": "image"},
        {"type": "text", "text": "and"},
        {"type": "image"},
        {"type": "image"},
        {"type": "text", "text": "?"},
    ]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )
    inputs = processor(text=text, images=sample_images, return_tensors="pt")
    captured: dict = {}
    hook = model.model.language_model.register_forward_pre_hook(
        lambda module, args, kwargs: captured.update(kwargs), with_kwargs=True
    )
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        hook.remove()
    rows = inputs["input_ids"][0] == spec.image_token_id
    inserted = captured["inputs_embeds"][0][rows]
    embeds = encode_images(model, processor, sample_images)
    counts = [image_layout(processor, img).num_tokens for img in sample_images]
    assert [tuple(e.shape) for e in embeds] == [(t, spec.hidden_size) for t in counts]
    grids = [f.grid_thw for f in encode(model, processor, sample_images)]
    assert grids == [image_layout(processor, img).grid_thw for img in sample_images]
    torch.testing.assert_close(torch.cat(embeds), inserted, atol=1e-6, rtol=1e-6)
    rows = min(embeds[0].shape[0], embeds[1].shape[0])  # different images, different embeddings
    assert not torch.allclose(embeds[0][:rows], embeds[1][:rows])
    assert encode_images(model, processor, []) == []
