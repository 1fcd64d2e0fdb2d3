"""Retrieval inside a query: explicit and automatic modes; hits are linkable entry keys."""

from __future__ import annotations

import pytest

from mpic.errors import InvalidRequestError, NotFoundError
from mpic.retriever.query import retrieve
from mpic.retriever.sources import open_source
from mpic.retriever.spec import RetrievalSpec
from tests.retriever.conftest import png_bytes, write_images


@pytest.fixture
def retriever(tmp_path, engine, make_retriever):
    r = make_retriever()
    write_images(tmp_path / "src", [0, 1, 2, 3])
    r.refresh(
        "refs", open_source(str(tmp_path / "src")), engine, model_fingerprint=engine.fingerprint
    )
    return r


def test_explicit_and_auto_modes(retriever) -> None:
    query = png_bytes(2, (46, 40))  # = img-002.png
    explicit = retrieve(retriever, RetrievalSpec(collection="refs", top_k=2), image=query)
    assert explicit.triggered and [h.name for h in explicit.hits][0] == "img-002.png"
    assert explicit.entry_keys == [h.entry_key for h in explicit.hits] and len(explicit.hits) == 2
    exact_only = retrieve(
        retriever, RetrievalSpec(collection="refs", top_k=4, min_score=0.9999), image=query
    )
    assert [h.name for h in exact_only.hits] == ["img-002.png"]

    auto = RetrievalSpec(collection="refs", top_k=2, mode="auto", threshold=0.9999)
    hit = retrieve(retriever, auto, image=query)
    assert hit.triggered and hit.hits[0].name == "img-002.png"
    text_scores = retriever.search("refs", text="a hotel lobby", top_k=1).hits[0].score
    assert text_scores < 0.9999  # random weights: text is far from every image
    miss = retrieve(retriever, auto, text="a hotel lobby")
    assert not miss.triggered and miss.hits == [] and miss.version == hit.version


def test_bad_specs(retriever) -> None:
    with pytest.raises(NotFoundError):
        retrieve(retriever, RetrievalSpec(collection="missing"), text="x")
    with pytest.raises(InvalidRequestError):
        retrieve(retriever, RetrievalSpec(collection="refs"), text="  ")
    with pytest.raises(ValueError):
        RetrievalSpec(collection="refs", top_k=0)
    with pytest.raises(ValueError):
        RetrievalSpec.model_validate({"collection": "refs", "k": 3})
