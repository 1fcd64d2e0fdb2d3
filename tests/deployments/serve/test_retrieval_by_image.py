"""Retrieval by image over HTTP, in-process on the fake engine (no Ray, no model; the CLIP
embedder and FAISS are the real ones): an image in the query turn (inline or an uploaded file) is
embedded by the collection's CLIP tower and searched alone or with the text, and
`"retrieval": "auto"` searches the collection an admin refreshed last when the config names no
default (400 saying what to set before any refresh). Expected hits are recomputed independently
from the CLIP embeddings with numpy."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest

from tests.deployments.conftest import ADMIN_KEY, KEYS
from tests.deployments.inprocess import fake_config, in_process_app
from tests.retriever.conftest import png_bytes

SEEDS = list(range(1, 9))


@pytest.fixture
def app(tmp_path: Path):
    cfg = fake_config(tmp_path / "store").model_copy(update={"admin_sources": [str(tmp_path)]})
    source = tmp_path / "refs"
    source.mkdir()
    images = {f"img-{s}.png": png_bytes(s, (40 + 3 * s, 36 + 2 * s)) for s in SEEDS}
    for name, data in images.items():
        (source / name).write_bytes(data)
    with in_process_app(cfg, KEYS, [ADMIN_KEY]) as running:
        running.source, running.images = source, images
        yield running


def _chat(app, content, retrieval) -> dict:
    resp = app.client.post(
        "/v1/chat/completions",
        headers=app.headers("alice-key"),
        json={
            "model": "mpic",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": content}],
            "mpic": {"retrieval": retrieval},
        },
    )
    return resp


def _refresh(app, name: str) -> None:
    resp = app.client.post(
        f"/v1/admin/collections/{name}/refresh",
        json={"source": str(app.source)},
        headers=app.headers(ADMIN_KEY),
    )
    assert resp.status_code == 200, resp.text


def _expected(app, collection: str, query: np.ndarray, k: int) -> list[str]:
    """Entry keys of the k items closest to the unit vector `query`, by numpy cosine."""
    service = app.ingress.retriever._obj.service
    manifest = service.library(collection).current()
    names = [it.extra["name"] for it in manifest.items]
    embedder = service.embedder()
    vectors = embedder.embed_images([app.images[n] for n in names])
    order = np.argsort(-(vectors @ query), kind="stable")[:k]
    return [manifest.items[i].entry_key for i in order]


def _data_url(data: bytes) -> dict:
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def test_image_only_query_retrieves_its_nearest_items(app) -> None:
    _refresh(app, "photos")
    embedder = app.ingress.retriever._obj.service.embedder()
    query = app.images["img-5.png"]
    (q,) = embedder.embed_images([query])
    want = _expected(app, "photos", q, 3)
    spec = {"collection": "photos", "top_k": 3}
    inline = _chat(app, [_data_url(query)], spec)  # no text at all
    assert inline.status_code == 200, inline.text
    assert inline.json()["mpic"]["retrieved"] == want
    manifest = app.ingress.retriever._obj.service.library("photos").current()
    own = next(it.entry_key for it in manifest.items if it.extra["name"] == "img-5.png")
    assert want[0] == own  # the image itself is its own nearest item
    up = app.client.post(  # the same image as an uploaded file reference
        "/v1/files",
        headers=app.headers("alice-key"),
        files={"file": ("q.png", query, "image/png")},
        data={"purpose": "vision"},
    )
    file_id = up.json()["id"]
    by_file = _chat(app, [{"type": "file", "file": {"file_id": file_id}}], spec)
    assert by_file.status_code == 200, by_file.text
    assert by_file.json()["mpic"]["retrieved"] == want


def test_image_and_text_are_one_combined_query(app) -> None:
    _refresh(app, "photos")
    embedder = app.ingress.retriever._obj.service.embedder()
    query, text = app.images["img-2.png"], "a striped gradient"
    combined = embedder.embed_images([query])[0] + embedder.embed_texts([text])[0]
    combined /= np.linalg.norm(combined)
    want = _expected(app, "photos", combined, 4)
    content = [_data_url(query), {"type": "text", "text": text}]
    got = _chat(app, content, {"collection": "photos", "top_k": 4})
    assert got.status_code == 200, got.text
    assert got.json()["mpic"]["retrieved"] == want


def test_auto_uses_the_last_refreshed_collection(app) -> None:
    query = [_data_url(app.images["img-3.png"])]
    before = _chat(app, query, "auto")
    assert before.status_code == 400
    assert "default_collection" in before.json()["error"]["message"]
    _refresh(app, "first")
    _refresh(app, "docs")  # the README's refresh: the last one is what auto searches
    assert app.config.default_collection is None
    got = _chat(app, query, "auto")
    assert got.status_code == 200, got.text
    manifest = app.ingress.retriever._obj.service.library("docs").current()
    own = next(it.entry_key for it in manifest.items if it.extra["name"] == "img-3.png")
    assert got.json()["mpic"]["retrieved"][0] == own
