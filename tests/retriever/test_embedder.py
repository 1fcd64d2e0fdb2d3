"""CLIP embedder: unit rows, deterministic random init, batching, weights from a file or a key."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpic.errors import InvalidRequestError, UnreadableMediaError
from mpic.retriever.embedder import ClipEmbedder, EmbedderConfig
from mpic.storage.factory import make_object_store
from tests.retriever.conftest import png_bytes

IMAGES = [png_bytes(s, (40 + 3 * s, 36 + 2 * s)) for s in range(5)]


@pytest.fixture(scope="module")
def embedder() -> ClipEmbedder:
    return ClipEmbedder(EmbedderConfig(batch_size=2))


def test_image_and_text_vectors_are_unit_rows(embedder: ClipEmbedder) -> None:
    img = embedder.embed_images(IMAGES)
    txt = embedder.embed_texts(["a red square", "a blue circle", ""])
    assert img.shape == (5, embedder.dim) and txt.shape == (3, embedder.dim)
    assert img.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(img, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(txt, axis=1), 1.0, atol=1e-5)
    assert not np.allclose(img[0], img[1])
    assert embedder.embed_images([]).shape == (0, embedder.dim)


def test_same_config_same_vectors_and_batching_does_not_matter(embedder: ClipEmbedder) -> None:
    other = ClipEmbedder(EmbedderConfig(batch_size=32))
    assert other.fingerprint == embedder.fingerprint
    np.testing.assert_allclose(other.embed_images(IMAGES), embedder.embed_images(IMAGES), atol=1e-5)
    assert ClipEmbedder(EmbedderConfig(seed=1)).fingerprint != embedder.fingerprint


def test_weights_from_file_and_object_store_key(tmp_path, embedder: ClipEmbedder) -> None:
    seeded = ClipEmbedder(EmbedderConfig(seed=7))
    path = tmp_path / "clip.pt"
    torch.save(seeded.model.state_dict(), path)
    from_file = ClipEmbedder(EmbedderConfig(weights=str(path)))
    expected = seeded.embed_images(IMAGES)
    np.testing.assert_allclose(from_file.embed_images(IMAGES), expected, atol=1e-5)
    assert not np.allclose(embedder.embed_images(IMAGES), expected, atol=1e-3)

    store = make_object_store(f"file://{tmp_path / 'store'}")
    store.put("models/clip.pt", path.read_bytes())
    from_key = ClipEmbedder(EmbedderConfig(weights_key="models/clip.pt"), get_bytes=store.get)
    np.testing.assert_allclose(from_key.embed_images(IMAGES), expected, atol=1e-5)
    assert from_key.fingerprint == from_file.fingerprint != embedder.fingerprint


def test_bad_inputs(tmp_path, embedder: ClipEmbedder) -> None:
    with pytest.raises(UnreadableMediaError, match="1: not a decodable image"):
        embedder.embed_images([IMAGES[0], b"not an image"])
    with pytest.raises(InvalidRequestError, match="not found"):
        ClipEmbedder(EmbedderConfig(weights=str(tmp_path / "missing.pt")))
    with pytest.raises(InvalidRequestError, match="unknown open_clip model"):
        ClipEmbedder(EmbedderConfig(model="no-such-clip"))
