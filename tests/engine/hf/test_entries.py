"""Cache entries on both tiny families: content address, layout, write/read through the storage
codec with corruption detected, unreadable images rejected with nothing kept."""

import io

import pytest
import torch

from mpic.engine.hf.reference_runner import ReferenceRunner
from mpic.engine.hf.vision import image_layout
from mpic.errors import CorruptEntryError, UnreadableMediaError
from mpic.storage.entry_codec import decode, encode
from mpic.types import MROPE_FAMILIES


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return ReferenceRunner(str(tiny_model_dir))


def test_entry_layout_and_content_address(runner, sample_images):
    spec = runner.spec
    data = _png(sample_images[1])
    entry = runner.cache_image(data)
    t = image_layout(runner.processor, sample_images[1]).num_tokens
    assert entry.keys.shape == (spec.num_layers, t, spec.num_kv_heads, spec.head_dim)
    assert entry.values.shape == entry.keys.shape
    assert entry.input_embeds.shape == (t, spec.hidden_size)
    c = len(entry.extra["context_token_ids"])
    if spec.family in MROPE_FAMILIES:
        assert entry.positions.shape == (3, t)
        grid = image_layout(runner.processor, sample_images[1]).grid_thw
        assert entry.extra["image_grid_thw"] == list(grid)
        assert int(entry.positions[0].max()) == c  # one frame: t = start
    else:
        assert torch.equal(entry.positions, torch.arange(c, c + t))
    again = runner.cache_image(data)
    assert again.entry_id == entry.entry_id and len(entry.entry_id) == 64
    other = runner.cache_image(_png(sample_images[2]))
    assert other.entry_id != entry.entry_id
    assert not torch.equal(other.keys, entry.keys)


def test_write_read_roundtrip_and_corruption(runner, sample_images):
    entry = runner.cache_image(_png(sample_images[0]))
    blob = encode(entry)
    back = decode(blob)
    assert back.entry_id == entry.entry_id and back.extra == entry.extra
    for name in ("keys", "values", "positions", "input_embeds"):
        assert torch.equal(getattr(back, name), getattr(entry, name))
    broken = bytearray(blob)
    broken[-5] ^= 0xFF
    with pytest.raises(CorruptEntryError):
        decode(bytes(broken))


def test_unreadable_image_is_rejected_and_nothing_kept(runner):
    before = dict(runner.entries)
    for data in (b"", b"not an image at all", b"\x89PNG\r\n\x1a\n" + b"\0" * 20):
        with pytest.raises(UnreadableMediaError):
            runner.cache_image(data)
    assert runner.entries == before
