"""Text passages in the dynamic library: .txt/.md files of a refresh source become "document"
items whose entries equal the engine's document recipe (the offline runner's `cache_document`)
and whose vectors come from CLIP's text tower (windows of the tower's context, mean of the
windows); one index answers text queries with passages and images; incremental refresh; bad
passages fail before anything is written."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpic.errors import InvalidRequestError, PromptTooLongError, UnreadableMediaError
from mpic.retriever.embedder import ClipEmbedder, EmbedderConfig
from mpic.retriever.sources import media_type, open_source
from tests.retriever.conftest import PASSAGES, CountingEngine, write_images, write_passages

WORDS = "red blue green cat dog sun moon tree house car".split()
"""Words that are one CLIP BPE token each (checked below)."""


@pytest.fixture(scope="module")
def embedder() -> ClipEmbedder:
    return ClipEmbedder(EmbedderConfig(device="cpu"))


def _refresh(retriever, folder, engine: CountingEngine, **kw):
    return retriever.refresh(
        "refs",
        open_source(str(folder)),
        engine,
        model_fingerprint=engine.fingerprint,
        compute_document=engine.document,
        **kw,
    )


def test_media_type_by_suffix() -> None:
    assert [media_type(n) for n in ("a.PNG", "b.txt", "c/d.md", "e.Markdown", "f.csv")] == [
        "image",
        "document",
        "document",
        "document",
        None,
    ]
    assert media_type(".hidden.txt") is None and media_type("dir/.x.md") is None


def test_passage_vectors_are_the_mean_of_context_windows(embedder: ClipEmbedder) -> None:
    tok = embedder.tokenizer
    assert all(len(tok.encode(w)) == 1 for w in WORDS)
    window = tok.context_length - 2  # 30 for mpic-tiny-clip
    short = "a red house under the moon"
    np.testing.assert_allclose(
        embedder.embed_passages([short]), embedder.embed_texts([short]), atol=1e-6
    )
    words = [WORDS[(7 * i) % len(WORDS)] for i in range(2 * window + 5)]  # 3 windows
    pieces = [" ".join(words[s : s + window]) for s in range(0, len(words), window)]
    want = embedder.embed_texts(pieces).mean(0)  # open_clip's own tokenizer, one window each
    want /= np.linalg.norm(want)
    got = embedder.embed_passages([" ".join(words), short])
    np.testing.assert_allclose(got[0], want, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    truncated = embedder.embed_texts([" ".join(words)])[0]  # what a plain query would keep
    assert float(got[0] @ truncated) < 0.9999
    with pytest.raises(InvalidRequestError, match="empty.txt: the passage has no text"):
        embedder.embed_passages(["ok", "  \n "], ["a.txt", "empty.txt"])


def test_passages_and_images_in_one_collection(tmp_path, engine, make_retriever, llava_hf):
    from mpic.engine.hf.adapters import make_adapter
    from mpic.engine.hf.entries import cache_document

    src = tmp_path / "src"
    images = write_images(src, [0, 1, 2])
    write_passages(src)
    retriever = make_retriever()
    report = _refresh(retriever, src, engine)
    assert (report.items, report.documents, report.computed) == (6, 3, 6)
    assert len(engine.calls) == 3 and sorted(engine.doc_calls) == sorted(PASSAGES.values())
    man = retriever.library("refs").current()
    kinds = {it.extra["name"]: it.media_type for it in man.items}
    assert kinds == {**dict.fromkeys(images, "image"), **dict.fromkeys(PASSAGES, "document")}

    model, processor, spec = llava_hf
    adapter = make_adapter(model)
    for name, text in PASSAGES.items():
        # a passage's own text is its nearest neighbour (one window: the query's exact vector)
        hits = retriever.search("refs", text=text, top_k=6).hits
        top = hits[0]
        assert (top.name, top.media_type) == (name, "document")
        assert top.score == pytest.approx(1.0, abs=1e-4) and top.score > hits[1].score
        assert {h.media_type for h in hits} == {"image", "document"}  # one index holds both
        stored = retriever.entries.get(top.entry_key)
        fresh = cache_document(processor, adapter, spec, text)  # the engine's document recipe
        assert stored.entry_id == fresh.entry_id == top.entry_key
        assert torch.equal(stored.keys, fresh.keys) and torch.equal(stored.values, fresh.values)
        assert stored.media_type == "text" and stored.extra["token_ids"] == fresh.extra["token_ids"]
        assert retriever.objects.get(top.media_key) == text.encode()
    for name, data in images.items():  # images still find themselves
        top = retriever.search("refs", image=data, top_k=1).hits[0]
        assert (top.name, top.media_type) == (name, "image")


def test_passages_refresh_incrementally(tmp_path, engine, make_retriever) -> None:
    src = tmp_path / "src"
    write_images(src, [0, 1])
    write_passages(src)
    retriever = make_retriever()
    first = _refresh(retriever, src, engine)
    old = {h.name: h for h in retriever.search("refs", text="x", top_k=10).hits}
    engine.calls.clear()
    engine.doc_calls.clear()
    same = _refresh(retriever, src, engine)  # nothing changed: no engine call at all
    assert engine.calls == engine.doc_calls == [] and (same.computed, same.reused) == (0, 5)

    (src / "pool.txt").write_text("The pool is closed for repairs this week.")  # changed
    (src / "breakfast.md").unlink()  # removed
    (src / "spa.md").write_text("The spa offers massages on request.")  # added
    second = _refresh(retriever, src, engine)
    assert sorted(engine.doc_calls) == [
        "The pool is closed for repairs this week.",
        "The spa offers massages on request.",
    ]
    assert (second.computed, second.reused, second.removed, second.documents) == (2, 3, 2, 3)
    assert second.parent == same.version and first.version != second.version
    new = {h.name: h for h in retriever.search("refs", text="x", top_k=10).hits}
    assert set(new) == {"img-000.png", "img-001.png", "pool.txt", "spa.md", "notes/parking.txt"}
    assert new["notes/parking.txt"].entry_key == old["notes/parking.txt"].entry_key
    assert new["pool.txt"].entry_key != old["pool.txt"].entry_key
    top = retriever.search("refs", text="The spa offers massages on request.", top_k=1).hits[0]
    assert top.name == "spa.md" and top.score == pytest.approx(1.0, abs=1e-4)


def test_bad_passages_fail_before_writing(tmp_path, engine, make_retriever) -> None:
    src = tmp_path / "src"
    write_images(src, [0])
    write_passages(src)
    retriever = make_retriever()
    v1 = _refresh(retriever, src, engine).version
    before = sorted(retriever.objects.list(""))
    engine.calls.clear()
    engine.doc_calls.clear()

    (src / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(UnreadableMediaError, match="latin1.txt is not UTF-8"):
        _refresh(retriever, src, engine)
    (src / "latin1.txt").unlink()
    (src / "blank.md").write_text(" \n\t\n")
    with pytest.raises(InvalidRequestError, match="blank.md: the passage has no text"):
        _refresh(retriever, src, engine)
    (src / "blank.md").unlink()
    (src / "new.txt").write_text("a new passage")
    with pytest.raises(InvalidRequestError, match="new.txt: this engine does not cache text"):
        retriever.refresh(
            "refs", open_source(str(src)), engine, model_fingerprint=engine.fingerprint
        )
    assert engine.calls == engine.doc_calls == []
    assert sorted(retriever.objects.list("")) == before  # nothing written by any of them

    (src / "new.txt").write_text(" ".join(["word"] * 2100))  # over the model's 2048 tokens
    with pytest.raises(PromptTooLongError, match="new.txt: the document has"):
        _refresh(retriever, src, engine)  # found by the engine: the version is aborted
    assert retriever.versions("refs") == ([v1], v1)
    assert retriever.search("refs", text="x", top_k=10).version == v1
