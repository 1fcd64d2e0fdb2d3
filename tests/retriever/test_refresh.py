"""Refresh of a dynamic-library collection: top-1 self retrieval, entries equal recomputation,
incremental reuse, de-duplication, captions, rollback, and atomicity under failures."""

from __future__ import annotations

import json

import pytest
import torch

from mpic.errors import NotFoundError, UnreadableMediaError
from mpic.retriever.refresh import INDEX_BLOB
from mpic.retriever.sources import open_source, read_captions
from tests.retriever.conftest import CountingEngine, png_bytes, write_images


def _refresh(retriever, folder, engine: CountingEngine, **kw):
    return retriever.refresh(
        "refs", open_source(str(folder)), engine, model_fingerprint=engine.fingerprint, **kw
    )


def test_every_image_is_its_own_top1_and_entries_are_exact(tmp_path, engine, make_retriever):
    images = write_images(tmp_path / "src", list(range(6)))
    (tmp_path / "src" / "sub").mkdir()
    (tmp_path / "src" / "sub" / "copy.png").write_bytes(images["img-002.png"])
    (tmp_path / "src" / "notes.csv").write_text("neither an image nor a passage, ignored")
    caps = tmp_path / "captions.jsonl"
    caps.write_text("\n".join(json.dumps({"file": n, "caption": f"cap {n}"}) for n in images))
    retriever = make_retriever()
    report = _refresh(retriever, tmp_path / "src", engine, captions=read_captions(caps))
    assert (report.items, report.computed, report.reused) == (6, 6, 0)
    assert report.duplicates == [("sub/copy.png", "img-002.png")]
    assert len(engine.calls) == 6

    for name, data in images.items():
        result = retriever.search("refs", image=data, top_k=3)
        assert result.version == report.version
        top = result.hits[0]
        assert top.name == name and top.caption == f"cap {name}"
        assert top.score == pytest.approx(1.0, abs=1e-4)
        assert top.score > result.hits[1].score
        stored = retriever.entries.get(top.entry_key)
        fresh = engine._compute(data)
        assert stored.entry_id == fresh.entry_id == top.entry_key
        assert torch.equal(stored.keys, fresh.keys) and torch.equal(stored.values, fresh.values)
        assert retriever.objects.get(top.media_key) == data
    text_hits = retriever.search("refs", text="a picture", top_k=10).hits
    assert len(text_hits) == 6 and [h.score for h in text_hits] == sorted(
        (h.score for h in text_hits), reverse=True
    )


def test_incremental_refresh_recomputes_only_changed_images(tmp_path, engine, make_retriever):
    src = tmp_path / "src"
    images = write_images(src, [0, 1, 2, 3])
    retriever = make_retriever()
    first = _refresh(retriever, src, engine)
    old = {h.name: h for h in retriever.search("refs", text="x", top_k=10).hits}
    (src / "img-003.png").unlink()  # removed
    (src / "img-001.png").write_bytes(png_bytes(99))  # changed content, same name
    write_images(src, [4])  # added
    engine.calls.clear()
    second = _refresh(retriever, src, engine)
    assert len(engine.calls) == 2 and set(engine.calls) == {
        png_bytes(99),
        (src / "img-004.png").read_bytes(),
    }
    assert (second.computed, second.reused, second.removed, second.parent) == (
        2,
        2,
        2,
        first.version,
    )
    new = {h.name: h for h in retriever.search("refs", text="x", top_k=10).hits}
    assert set(new) == {"img-000.png", "img-001.png", "img-002.png", "img-004.png"}
    for name in ("img-000.png", "img-002.png"):
        assert new[name].entry_key == old[name].entry_key
    assert new["img-001.png"].entry_key != old["img-001.png"].entry_key
    assert retriever.search("refs", image=images["img-003.png"], top_k=1).hits[0].score < 0.999
    assert retriever.search("refs", image=png_bytes(99), top_k=1).hits[0].name == "img-001.png"

    engine.calls.clear()
    third = _refresh(retriever, src, engine)  # nothing changed: no engine call
    assert engine.calls == [] and (third.computed, third.reused) == (0, 4)
    engine.calls.clear()
    retriever.refresh("refs", open_source(str(src)), engine, model_fingerprint="other-model")
    assert len(engine.calls) == 4  # another model: all recomputed


def test_rollback_to_any_kept_version(tmp_path, engine, make_retriever):
    retriever = make_retriever()
    write_images(tmp_path / "a", [0, 1])
    write_images(tmp_path / "b", [2, 3, 4])
    v1 = _refresh(retriever, tmp_path / "a", engine).version
    v2 = _refresh(retriever, tmp_path / "b", engine).version
    assert retriever.versions("refs") == ([v1, v2], v2)
    retriever.rollback("refs", v1)
    result = retriever.search("refs", text="x", top_k=10)
    assert result.version == v1 and {h.name for h in result.hits} == {"img-000.png", "img-001.png"}
    retriever.rollback("refs", v2)
    assert len(retriever.search("refs", text="x", top_k=10).hits) == 3
    with pytest.raises(NotFoundError):
        retriever.rollback("refs", "v-nope")
    with pytest.raises(NotFoundError):
        retriever.search("nope", text="x")

    v3 = _refresh(retriever, tmp_path / "a", engine).version
    retriever.rollback("refs", v1)
    assert retriever.prune("refs", keep=1) == [v2]  # v1 is current: kept with the newest
    assert retriever.versions("refs") == ([v1, v3], v1)
    with pytest.raises(NotFoundError):
        retriever.rollback("refs", v2)
    assert {h.name for h in retriever.search("refs", text="x", top_k=10).hits} == {
        "img-000.png",
        "img-001.png",
    }


def test_failed_refresh_leaves_old_version_and_nothing_visible(tmp_path, engine, make_retriever):
    retriever = make_retriever()
    write_images(tmp_path / "a", [0, 1])
    v1 = _refresh(retriever, tmp_path / "a", engine).version
    before = sorted(retriever.objects.list("dynamic/"))
    write_images(tmp_path / "b", [5, 6, 7, 8])
    engine.fail_at = 3  # two entries stored, then the engine dies
    with pytest.raises(RuntimeError, match="injected"):
        _refresh(retriever, tmp_path / "b", engine)
    assert retriever.versions("refs") == ([v1], v1)
    assert sorted(retriever.objects.list("dynamic/")) == before  # aborted version's blobs gone
    assert retriever.search("refs", text="x", top_k=10).version == v1

    (tmp_path / "b" / "broken.png").write_bytes(b"\x89PNG but not really")
    engine.calls.clear()
    with pytest.raises(UnreadableMediaError, match="broken.png|not a decodable image"):
        _refresh(retriever, tmp_path / "b", engine)
    assert engine.calls == [] and retriever.versions("refs") == ([v1], v1)


def test_refresh_from_s3_prefix_into_s3_store(s3_server, engine):
    from mpic.retriever.service import RetrievalService
    from mpic.storage.s3_store import S3ObjectStore

    src_cfg = s3_server.config(prefix="refs/2026")
    src = S3ObjectStore(src_cfg)
    images = {f"img-{s}.png": png_bytes(s) for s in range(3)}
    for name, data in images.items():
        src.put(f"batch/{name}", data)
    src.put("batch/readme.txt", b"Reference pictures of the hotel, taken in 2026.")
    src.put("batch/data.csv", b"ignored")
    url = (
        f"s3://{src_cfg.bucket}/refs/2026?endpoint={s3_server.endpoint}&secure=false"
        "&access_key=testing&secret_key=testing&region=us-east-1"
    )
    source = open_source(url)
    assert source.names == [f"batch/{n}" for n in sorted(images)] + ["batch/readme.txt"]
    # moto serves from a thread of this process: allow for a busy machine
    retriever = RetrievalService(
        S3ObjectStore(s3_server.config().model_copy(update={"timeout_s": 30.0}))
    )
    report = retriever.refresh(
        "s3refs",
        source,
        engine,
        model_fingerprint=engine.fingerprint,
        compute_document=engine.document,
    )
    assert (report.items, report.documents) == (4, 1) and retriever.collections() == ["s3refs"]
    assert engine.doc_calls == ["Reference pictures of the hotel, taken in 2026."]
    man = retriever.library("s3refs").current()
    assert INDEX_BLOB in man.blobs
    for name, data in images.items():
        assert retriever.search("s3refs", image=data, top_k=1).hits[0].name == f"batch/{name}"


def test_image_changing_during_refresh_fails_before_writing(tmp_path, engine, make_retriever):
    from mpic.errors import InvalidRequestError
    from mpic.retriever.sources import MediaSource

    write_images(tmp_path / "a", [0, 1])
    real = open_source(str(tmp_path / "a"))
    reads: dict[str, int] = {}

    def read(name: str) -> bytes:  # the file is rewritten after the hashing pass
        reads[name] = reads.get(name, 0) + 1
        return real.read(name) if reads[name] == 1 else png_bytes(50)

    retriever = make_retriever()
    with pytest.raises(InvalidRequestError, match="changed during the refresh"):
        retriever.refresh(
            "refs",
            MediaSource(real.location, real.names, read),
            engine,
            model_fingerprint=engine.fingerprint,
        )
    assert engine.calls == [] and retriever.collections() == []
