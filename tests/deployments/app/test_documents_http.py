"""Text documents over HTTP (the session's real local Ray Serve app on the tiny LLaVA): two
uploaded .txt/.md files (purpose user_data) and an image in one chat, linked exactly as the
offline reference runner links them; isolation, content, and the 4xx answers of bad files."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.deployments.conftest import ServeApp, chat, png, upload

pytestmark = pytest.mark.slow

NOTES = (
    "red squares sit left of the blue circles\nthe green line runs under them",
    "# Shopping\n- two apples\n- a loaf of bread",
)


@pytest.fixture(scope="module")
def offline(tiny_llava_dir: Path):
    """The offline engine on the same model folder (the oracle)."""
    from mpic.engine.hf.reference_runner import ReferenceRunner

    return ReferenceRunner(str(tiny_llava_dir))


def _file(fid: str) -> dict:
    return {"type": "file", "file": {"file_id": fid}}


@pytest.mark.parametrize("policy", ["full", "mpic-4", "boundary-2"])
def test_two_text_files_and_an_image_answer_like_offline(
    serve_app: ServeApp, offline, policy: str
) -> None:
    from mpic.prompt_parts import DocumentRef, ImageRef

    docs = [
        upload(serve_app, "alice-key", NOTES[0].encode(), "notes.txt", purpose="user_data"),
        upload(serve_app, "alice-key", NOTES[1].encode(), "list.md", purpose="user_data"),
    ]
    for resp in docs:
        assert resp.status_code == 200, resp.text
        assert resp.json()["purpose"] == "user_data" and resp.json()["tokens"] > 0
    img = upload(serve_app, "alice-key", png(21))
    assert img.status_code == 200, img.text
    d1, d2, im = docs[0].json()["id"], docs[1].json()["id"], img.json()["id"]
    content = [
        {"type": "text", "text": "read"},
        _file(d1),
        {"type": "text", "text": "look"},
        _file(im),
        {"type": "text", "text": "and"},
        _file(d2),
        {"type": "text", "text": "what now?"},
    ]
    resp = chat(serve_app, "alice-key", content, policy=policy)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    e1, e2 = (offline.cache_document(t).entry_id for t in NOTES)
    ei = offline.cache_image(png(21)).entry_id
    parts = ["read", DocumentRef(e1), "look", ImageRef(ei), "and", DocumentRef(e2), "what now?"]
    gen = offline.generate(parts, policy, 6)
    want = offline.processor.tokenizer.decode(gen.tokens, skip_special_tokens=True)
    assert body["choices"][0]["message"]["content"] == want
    assert body["usage"]["prompt_tokens"] == gen.prefilled.plan.num_tokens
    if policy != "full":
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_document_files_isolation_content_and_errors(serve_app: ServeApp) -> None:
    resp = upload(serve_app, "alice-key", NOTES[0].encode(), "n.txt", purpose="user_data")
    fid = resp.json()["id"]
    got = httpx.get(
        f"{serve_app.url}/v1/files/{fid}/content", headers=serve_app.headers("alice-key")
    )
    assert got.status_code == 200 and got.content == NOTES[0].encode()
    other = chat(serve_app, "bob-key", [_file(fid), {"type": "text", "text": "?"}])
    assert other.status_code == 404 and other.json()["error"]["code"]
    bad = upload(serve_app, "alice-key", b"\xff\xfe\x00bad", "b.txt", purpose="user_data")
    assert bad.status_code == 415 and "UTF-8" in bad.json()["error"]["message"]
    empty = upload(serve_app, "alice-key", b"", "e.txt", purpose="user_data")
    assert empty.status_code == 400 and "no text" in empty.json()["error"]["message"]
