"""End-to-end HTTP tests against the session's real local Ray Serve instance: answers equal the
offline reference runner's for the same prompt and policy (cached files, inline images, MRAG
retrieval), every error code, user isolation, admin routes, SSE, metrics."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import httpx
import pytest

from tests.deployments.conftest import ADMIN_KEY, MAX_UPLOAD, ServeApp, chat, png, upload

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def offline(tiny_llava_dir: Path):
    """The offline engine on the same model folder (the oracle of every answer)."""
    from mpic.engine.hf.reference_runner import ReferenceRunner

    return ReferenceRunner(str(tiny_llava_dir))


def _offline_answer(
    runner, parts: list, policy: str, max_tokens: int = 6, system: str | None = None
) -> str:
    gen = runner.generate(parts, policy, max_tokens, system_prompt=system)
    return runner.processor.tokenizer.decode(gen.tokens, skip_special_tokens=True)


def _file(fid: str) -> dict:
    return {"type": "file", "file": {"file_id": fid}}


@pytest.mark.parametrize("policy", ["full", "mpic-4", "cacheblend-15"])
def test_answer_equals_offline_engine(serve_app: ServeApp, offline, policy: str) -> None:
    from mpic.linker.prompt import ImageRef

    images = [png(11), png(12)]
    ids = [upload(serve_app, "alice-key", d).json()["id"] for d in images]
    content = [
        {"type": "text", "text": "first"},
        _file(ids[0]),
        {"type": "text", "text": "then"},
        _file(ids[1]),
        {"type": "text", "text": "why?"},
    ]
    resp = chat(serve_app, "alice-key", content, policy=policy)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    entries = [offline.cache_image(d).entry_id for d in images]
    parts = ["first", ImageRef(entries[0]), "then", ImageRef(entries[1]), "why?"]
    assert body["choices"][0]["message"]["content"] == _offline_answer(offline, parts, policy)
    linked = {"full": 0, "mpic-4": 2 * (16 - 4), "cacheblend-15": 0}[policy]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == linked  # depth-0 tokens
    assert body["mpic"]["tier_hits"] and body["mpic"]["fallbacks"] == 0


def test_request_system_prompt_links_like_offline(serve_app: ServeApp, offline) -> None:
    from mpic.linker.prompt import ImageRef

    data = png(15)
    fid = upload(serve_app, "alice-key", data).json()["id"]
    system = "You answer in one word."
    resp = chat(
        serve_app,
        "alice-key",
        [_file(fid), {"type": "text", "text": "colour?"}],
        messages=[
            {"role": "system", "content": system},
            {"role": "user", "content": [_file(fid), {"type": "text", "text": "colour?"}]},
        ],
    )
    assert resp.status_code == 200, resp.text
    parts = [ImageRef(offline.cache_image(data).entry_id), "colour?"]
    expected = _offline_answer(offline, parts, "mpic-4", system=system)
    assert resp.json()["choices"][0]["message"]["content"] == expected
    plain = chat(serve_app, "alice-key", [_file(fid), {"type": "text", "text": "colour?"}])
    assert resp.json()["usage"]["prompt_tokens"] != plain.json()["usage"]["prompt_tokens"]


def test_inline_image_is_linked_but_not_cached(serve_app: ServeApp, offline) -> None:
    from mpic.linker.prompt import ImageRef

    data = png(21)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    content = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}]
    resp = chat(serve_app, "bob-key", content, policy="mpic-4")
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    entry = offline.cache_image(data)
    expected = _offline_answer(offline, ["look", ImageRef(entry.entry_id)], "mpic-4")
    assert resp.json()["choices"][0]["message"]["content"] == expected
    listed = httpx.get(f"{serve_app.url}/v1/files", headers=serve_app.headers("bob-key"))
    assert listed.json()["data"] == []  # nothing was stored for bob


def test_retrieval_and_admin_routes(serve_app: ServeApp, offline, tmp_path: Path) -> None:
    from mpic.linker.prompt import ImageRef

    folder = tmp_path / "refs"
    folder.mkdir()
    media = {f"r{i}.png": png(100 + i) for i in range(3)}
    for name, data in media.items():
        (folder / name).write_bytes(data)
    admin = serve_app.headers(ADMIN_KEY)
    base = f"{serve_app.url}/v1/admin/collections"
    forbidden = httpx.post(
        f"{base}/docs/refresh", json={"source": str(folder)}, headers=serve_app.headers("alice-key")
    )
    assert forbidden.status_code == 403
    assert forbidden.json()["error"]["type"] == "permission_error"
    first = httpx.post(
        f"{base}/docs/refresh", json={"source": str(folder)}, headers=admin, timeout=300
    )
    assert first.status_code == 200, first.text
    assert first.json()["items"] == 3 and first.json()["computed"] == 3
    (folder / "r0.png").unlink()
    second = httpx.post(
        f"{base}/docs/refresh", json={"source": str(folder)}, headers=admin, timeout=300
    ).json()
    assert second["items"] == 2 and second["reused"] == 2 and second["removed"] == 1
    versions = httpx.get(f"{base}/docs/versions", headers=admin).json()
    assert versions["versions"] == sorted([first.json()["version"], second["version"]])
    assert versions["current"] == second["version"]
    listing = httpx.get(base, headers=admin).json()["data"]
    docs = [c for c in listing if c["collection"] == "docs"]
    assert docs == [{"collection": "docs", "current": second["version"], "items": 2}]

    content = [{"type": "text", "text": "what do the references show?"}]
    spec = {"collection": "docs", "top_k": 2, "min_score": -1.0}
    resp = chat(
        serve_app,
        "alice-key",
        content,
        policy="mpic-4",
        mpic={"policy": "mpic-4", "retrieval": spec},
    )
    assert resp.status_code == 200, resp.text
    retrieved = resp.json()["mpic"]["retrieved"]
    offline_ids = {offline.cache_image(d).entry_id: n for n, d in media.items()}
    assert len(retrieved) == 2 and {offline_ids[e] for e in retrieved} == {"r1.png", "r2.png"}
    parts = [ImageRef(e) for e in retrieved] + ["what do the references show?"]
    assert resp.json()["choices"][0]["message"]["content"] == _offline_answer(
        offline, parts, "mpic-4"
    )

    back = httpx.post(
        f"{base}/docs/rollback", json={"version": first.json()["version"]}, headers=admin
    )
    assert back.status_code == 200 and back.json()["current"] == first.json()["version"]
    resp = chat(
        serve_app,
        "alice-key",
        content,
        mpic={"policy": "mpic-4", "retrieval": {**spec, "top_k": 3}},
    )
    assert {offline_ids[e] for e in resp.json()["mpic"]["retrieved"]} == set(media)
    missing = httpx.post(f"{base}/docs/rollback", json={"version": "nope"}, headers=admin)
    assert missing.status_code == 404
    unknown = chat(serve_app, "alice-key", content, mpic={"retrieval": {"collection": "none"}})
    assert unknown.status_code == 404


def _err(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"] and err["type"]
    return err


def test_every_error_code(serve_app: ServeApp) -> None:
    url, alice = serve_app.url, serve_app.headers("alice-key")
    _err(httpx.get(f"{url}/v1/files"), 401)
    assert (
        _err(httpx.get(f"{url}/v1/files", headers=serve_app.headers("wrong")), 401)["type"]
        == "authentication_error"
    )
    _err(httpx.get(f"{url}/v1/admin/collections", headers=alice), 403)
    _err(httpx.get(f"{url}/v1/files/file-{'x' * 24}", headers=alice), 404)
    _err(upload(serve_app, "alice-key", b"\0" * (MAX_UPLOAD + 1)), 413)
    assert (
        _err(upload(serve_app, "alice-key", b"GIF89a-not-really"), 415)["code"]
        == "unsupported_media_type"
    )
    _err(upload(serve_app, "alice-key", png(1), purpose="fine-tune"), 400)
    _err(httpx.post(f"{url}/v1/chat/completions", headers=alice, json={"model": "m"}), 400)
    bad_part = [{"type": "video", "video": {}}]
    _err(chat(serve_app, "alice-key", bad_part), 400)
    assert (
        _err(chat(serve_app, "alice-key", [{"type": "text", "text": "hi"}], policy="magic"), 400)[
            "param"
        ]
        == "mpic.policy"
    )
    remote = [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]
    _err(chat(serve_app, "alice-key", remote), 400)

    fid = upload(serve_app, "alice-key", png(31), ttl_seconds="1").json()["id"]
    assert httpx.get(f"{url}/v1/files/{fid}", headers=alice).status_code == 200
    time.sleep(1.5)
    assert _err(httpx.get(f"{url}/v1/files/{fid}", headers=alice), 410)["code"] == "expired"
    _err(chat(serve_app, "alice-key", [_file(fid)]), 410)
    assert fid not in [f["id"] for f in httpx.get(f"{url}/v1/files", headers=alice).json()["data"]]


def test_user_isolation(serve_app: ServeApp) -> None:
    url = serve_app.url
    fid = upload(serve_app, "alice-key", png(41)).json()["id"]
    bob = serve_app.headers("bob-key")
    assert fid not in [f["id"] for f in httpx.get(f"{url}/v1/files", headers=bob).json()["data"]]
    unknown = httpx.get(f"{url}/v1/files/file-{'y' * 24}", headers=bob)
    foreign = httpx.get(f"{url}/v1/files/{fid}", headers=bob)
    assert foreign.status_code == unknown.status_code == 404
    assert foreign.json()["error"]["code"] == unknown.json()["error"]["code"]
    _err(chat(serve_app, "bob-key", [_file(fid)]), 404)
    _err(httpx.delete(f"{url}/v1/files/{fid}", headers=bob), 404)
    alice = serve_app.headers("alice-key")
    assert httpx.get(f"{url}/v1/files/{fid}", headers=alice).status_code == 200  # untouched


def test_sse_stream_and_metrics(serve_app: ServeApp) -> None:
    fid = upload(serve_app, "alice-key", png(51)).json()["id"]
    body = {
        "model": "mpic",
        "stream": True,
        "max_tokens": 4,
        "mpic": {"policy": "mpic-4"},
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": [_file(fid), {"type": "text", "text": "?"}]}],
    }
    events = []
    with httpx.stream(
        "POST",
        f"{serve_app.url}/v1/chat/completions",
        json=body,
        timeout=120,
        headers=serve_app.headers("alice-key"),
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    assert sum(1 for c in chunks if c["choices"] and "content" in c["choices"][0]["delta"]) == 4
    assert httpx.get(f"{serve_app.url}/healthz").json() == {"status": "ok"}
    # Ray's metrics agents export every few seconds: poll until this request's series arrive.
    deadline = time.monotonic() + 60
    while True:
        samples = _metric_samples(httpx.get(f"{serve_app.url}/metrics", timeout=30).text)
        missing = [
            name
            for name, labels in [
                ("ray_mpic_ttft_seconds_count", {"policy": "mpic"}),
                ("ray_mpic_inter_token_seconds_count", {"policy": "mpic"}),
                ("ray_mpic_store_hits_total", {"tier": "memory"}),
                ("ray_mpic_cached_tokens_total", {}),
                ("ray_mpic_output_tokens_total", {}),
                ("ray_mpic_requests_total", {"outcome": "ok"}),
            ]
            if not any(
                n == name and v > 0 and labels.items() <= lab.items() for n, lab, v in samples
            )
        ]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not missing, missing


def _metric_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample of a Prometheus exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]
