"""Fixtures of the retriever tests: a folder of distinct reference images (and text passages),
the tiny LLaVA's real entry computation of images and documents (wrapped to count engine calls)
and helpers to build a Retriever on a store."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from mpic.types import CacheEntry


def png_bytes(seed: int, size: tuple[int, int] = (48, 40)) -> bytes:
    """A deterministic RGB image (noise over a coloured gradient), PNG-encoded."""
    rng = np.random.RandomState(seed)
    w, h = size
    ys, xs = np.mgrid[0:h, 0:w]
    base = np.stack([xs * (seed % 7 + 1), ys * (seed % 5 + 1), (xs + ys) * 3], -1) % 256
    pixels = (0.6 * base + 0.4 * rng.randint(0, 255, (h, w, 3))).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def write_images(folder: Path, seeds: list[int]) -> dict[str, bytes]:
    """`img-<seed>.png` for each seed under `folder`; returns {name: bytes}."""
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for s in seeds:
        out[f"img-{s:03d}.png"] = png_bytes(s, (40 + 3 * s, 36 + 2 * s))
        (folder / f"img-{s:03d}.png").write_bytes(out[f"img-{s:03d}.png"])
    return out


PASSAGES = {
    "pool.txt": "The hotel has a heated outdoor pool open from May to September.",
    "breakfast.md": "# Breakfast\nServed from seven to ten in the garden room.",
    "notes/parking.txt": "Parking is free for guests; the garage closes at midnight.",
}
"""Text passages of a reference folder: {name relative to the folder: text}."""


def write_passages(folder: Path, passages: dict[str, str] | None = None) -> dict[str, str]:
    """Write `passages` (default PASSAGES) as UTF-8 files under `folder`; returns them."""
    passages = PASSAGES if passages is None else passages
    for name, text in passages.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text, encoding="utf-8")
    return passages


class CountingEngine:
    """The real tiny-LLaVA `cache_image` (call it) and `cache_document` (`document`), counting
    calls; `fail_at` raises on that image call."""

    def __init__(self, hf: tuple[Any, Any, Any]) -> None:
        from mpic.engine.hf.adapters import make_adapter
        from mpic.engine.hf.entries import cache_document, cache_image

        model, processor, self.spec = hf
        adapter = make_adapter(model)
        self._compute = lambda media: cache_image(model, processor, adapter, self.spec, media)
        self._document = lambda text: cache_document(processor, adapter, self.spec, text)
        self.calls: list[bytes] = []
        self.doc_calls: list[str] = []
        self.fail_at: int | None = None

    def document(self, text: str) -> CacheEntry:
        """The entry of a text passage (the engine's document recipe), counted."""
        self.doc_calls.append(text)
        return self._document(text)

    @property
    def fingerprint(self) -> str:
        """The model fingerprint a refresh records."""
        return self.spec.fingerprint

    def __call__(self, media: bytes) -> CacheEntry:
        self.calls.append(media)
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise RuntimeError("injected engine failure")
        return self._compute(media)


@pytest.fixture(scope="session")
def llava_hf(tiny_llava_dir: Path) -> tuple[Any, Any, Any]:
    """(model, processor, spec) of the tiny LLaVA, loaded once."""
    from mpic.engine.hf.loader import load_hf_model

    return load_hf_model(tiny_llava_dir)


@pytest.fixture
def engine(llava_hf: tuple[Any, Any, Any]) -> CountingEngine:
    """A fresh call counter over the shared tiny LLaVA."""
    return CountingEngine(llava_hf)


@pytest.fixture
def make_retriever(tmp_path: Path) -> Callable[..., Any]:
    """make_retriever(**cfgs) -> Retriever on a fresh filesystem store under tmp_path."""
    from mpic.retriever.service import RetrievalService
    from mpic.storage.factory import make_object_store

    def make(**cfgs: Any) -> RetrievalService:
        return RetrievalService(make_object_store(f"file://{tmp_path / 'store'}"), **cfgs)

    return make
