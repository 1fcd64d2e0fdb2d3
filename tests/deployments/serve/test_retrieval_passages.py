"""MRAG with text passages over HTTP, in-process (no Ray): the admin refresh route builds a
collection from a folder of an image and .txt/.md passages with the serving engine; a chat's
`mpic.retrieval` links the retrieved passages as documents and the image as an image, before
the question, and the answer equals the offline reference runner given the same DocumentRef /
ImageRef parts (policies full and mpic-4). The fake engine, which caches no documents, refuses a
source with passages (415 naming the file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deployments.conftest import ADMIN_KEY, KEYS, png
from tests.deployments.inprocess import fake_config, in_process_app

PASSAGES = {
    "pool.txt": "The heated pool is open from May to September.",
    "rooms/breakfast.md": "# Breakfast\nServed from seven to ten in the garden room.",
}
IMAGE = png(71)


def _source(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "view.png").write_bytes(IMAGE)
    for name, text in PASSAGES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def app(tiny_llava_dir: Path, tmp_path_factory):
    base = tmp_path_factory.mktemp("passages")
    cfg = fake_config(base / "store", kind="reference", model=str(tiny_llava_dir))
    cfg = cfg.model_copy(update={"admin_sources": [str(base)]})
    _source(base / "refs")
    with in_process_app(cfg, KEYS, [ADMIN_KEY]) as running:
        running.source = base / "refs"
        yield running


@pytest.fixture(scope="module")
def offline(tiny_llava_dir: Path):
    from mpic.engine.hf.reference_runner import ReferenceRunner

    return ReferenceRunner(str(tiny_llava_dir))


@pytest.fixture(scope="module")
def refreshed(app) -> dict:
    resp = app.client.post(
        "/v1/admin/collections/hotel/refresh",
        json={"source": str(app.source)},
        headers=app.headers(ADMIN_KEY),
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_refresh_route_caches_passages_with_the_serving_engine(refreshed, offline) -> None:
    assert (refreshed["items"], refreshed["documents"], refreshed["computed"]) == (3, 2, 3)


def _ask(app, question: str, policy: str, top_k: int):
    """A chat whose only text is `question`, retrieving `top_k` items of "hotel"."""
    return app.client.post(
        "/v1/chat/completions",
        headers=app.headers("alice-key"),
        json={
            "model": "mpic",
            "max_tokens": 6,
            "messages": [{"role": "user", "content": [{"type": "text", "text": question}]}],
            "mpic": {
                "policy": policy,
                "retrieval": {"collection": "hotel", "top_k": top_k, "min_score": -1.0},
            },
        },
    )


@pytest.mark.parametrize("policy", ["full", "mpic-4"])
def test_retrieved_passages_link_as_documents_like_offline(
    app, refreshed, offline, policy: str
) -> None:
    from mpic.prompt_parts import DocumentRef, ImageRef

    question = PASSAGES["pool.txt"]  # its own passage is the best hit (cosine 1)
    resp = _ask(app, question, policy, top_k=3)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    refs = {offline.cache_document(t).entry_id: DocumentRef for t in PASSAGES.values()}
    refs[offline.cache_image(IMAGE).entry_id] = ImageRef
    retrieved = body["mpic"]["retrieved"]
    assert sorted(retrieved) == sorted(refs)
    assert retrieved[0] == offline.cache_document(question).entry_id
    parts = [refs[e](e) for e in retrieved] + [question]
    gen = offline.generate(parts, policy, 6)
    want = offline.processor.tokenizer.decode(gen.tokens, skip_special_tokens=True)
    assert body["choices"][0]["message"]["content"] == want
    assert body["usage"]["prompt_tokens"] == gen.prefilled.plan.num_tokens
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert (cached == 0) if policy == "full" else (cached > 0)


def test_lost_passage_entry_is_recomputed_as_a_document(app, refreshed, offline) -> None:
    from mpic.prompt_parts import DocumentRef

    question = PASSAGES["rooms/breakfast.md"]
    entry = offline.cache_document(question).entry_id
    app.worker.entries.delete(entry)  # every tier: recomputed from the stored passage bytes
    resp = _ask(app, question, "mpic-4", top_k=1)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["mpic"]["retrieved"] == [entry] and body["mpic"]["fallbacks"] == 1
    gen = offline.generate([DocumentRef(entry), question], "mpic-4", 6)
    want = offline.processor.tokenizer.decode(gen.tokens, skip_special_tokens=True)
    assert body["choices"][0]["message"]["content"] == want


def test_fake_engine_refuses_passages(tmp_path: Path) -> None:
    cfg = fake_config(tmp_path / "store").model_copy(update={"admin_sources": [str(tmp_path)]})
    source = _source(tmp_path / "refs")
    with in_process_app(cfg, KEYS, [ADMIN_KEY]) as fake:
        resp = fake.client.post(
            "/v1/admin/collections/hotel/refresh",
            json={"source": str(source)},
            headers=fake.headers(ADMIN_KEY),
        )
        assert resp.status_code == 415, resp.text
        assert "pool.txt" in resp.json()["error"]["message"]
        listing = fake.client.get("/v1/admin/collections", headers=fake.headers(ADMIN_KEY))
        assert listing.json()["data"] == []  # nothing was committed


@pytest.mark.slow
def test_passages_over_ray_serve(serve_app, offline, tmp_path_factory) -> None:
    """The same on the session's real Ray Serve app: the Retriever replica asks the LLM worker
    replica for each passage's entry (`make_document_entry` over a Serve handle)."""
    import httpx

    from mpic.prompt_parts import DocumentRef, ImageRef
    from tests.deployments.conftest import chat

    source = _source(tmp_path_factory.mktemp("ray-passages") / "refs")
    resp = httpx.post(
        f"{serve_app.url}/v1/admin/collections/passages/refresh",
        json={"source": str(source)},
        headers=serve_app.headers(ADMIN_KEY),
        timeout=300,
    )
    assert resp.status_code == 200, resp.text
    assert (resp.json()["items"], resp.json()["documents"]) == (3, 2)
    question = PASSAGES["rooms/breakfast.md"]
    spec = {"collection": "passages", "top_k": 2, "min_score": -1.0}
    got = chat(
        serve_app,
        "alice-key",
        [{"type": "text", "text": question}],
        mpic={"policy": "mpic-4", "retrieval": spec},
    )
    assert got.status_code == 200, got.text
    refs = {offline.cache_document(t).entry_id: DocumentRef for t in PASSAGES.values()}
    refs[offline.cache_image(IMAGE).entry_id] = ImageRef
    retrieved = got.json()["mpic"]["retrieved"]
    assert retrieved[0] == offline.cache_document(question).entry_id and len(retrieved) == 2
    gen = offline.generate([refs[e](e) for e in retrieved] + [question], "mpic-4", 6)
    want = offline.processor.tokenizer.decode(gen.tokens, skip_special_tokens=True)
    assert got.json()["choices"][0]["message"]["content"] == want
