"""Hardening of the HTTP surface (issue 16), in-process on the fake engine (no Ray, no model):
auth before the body is read, body limits while reading, decompression bombs refused from the
header, request-shape limits, admin refresh sources limited to configured roots (no connection
made otherwise), engine budget 429 with Retry-After, a dead engine 503 + failing health check,
and a client disconnect closing the engine's generator."""

from __future__ import annotations

import asyncio
import struct
import threading
import time
import zlib
from pathlib import Path

import pytest

from tests.deployments.conftest import ADMIN_KEY, KEYS, png
from tests.deployments.inprocess import LocalHandle, fake_config, in_process_app


def _app(tmp_path: Path, **changes):
    cfg = fake_config(tmp_path / "store")
    for section, values in changes.items():
        if isinstance(values, dict):
            values = getattr(cfg, section).model_copy(update=values)
        cfg = cfg.model_copy(update={section: values})
    return in_process_app(cfg, KEYS, [ADMIN_KEY])


def _is_error(r, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code, err
    return err


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares width x height (8-bit RGB) with a tiny IDAT: 100 bytes on the wire."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_anonymous_1gb_upload_refused_before_reading(fake_app) -> None:
    sent = 0

    def body():
        nonlocal sent
        chunk = b"\0" * (1 << 20)
        for _ in range(1024):  # 1 GiB if anyone read it all
            sent += len(chunk)
            yield chunk

    t0 = time.perf_counter()
    r = fake_app.client.post(
        "/v1/files", content=body(), headers={"content-type": "multipart/form-data; boundary=x"}
    )
    elapsed = time.perf_counter() - t0
    _is_error(r, 401, "invalid_api_key")
    assert r.headers["www-authenticate"] == "Bearer"
    assert elapsed < 1.0, elapsed
    assert sent <= 2 << 20, sent  # at most what the transport buffered, never the gigabyte


def test_body_limits_while_reading(fake_app) -> None:
    h = fake_app.headers("alice-key")
    # declared too large: refused from the header
    r = fake_app.client.post(
        "/v1/files",
        headers={**h, "content-length": str(10 << 30), "content-type": "multipart/form-data"},
        content=b"",
    )
    _is_error(r, 413, "payload_too_large")
    # a JSON route over max_body_bytes
    big = fake_app.config.limits.max_body_bytes + 1
    r = fake_app.client.post(
        "/v1/chat/completions",
        headers={**h, "content-type": "application/json"},
        content=b"{" + b" " * big + b"}",
    )
    _is_error(r, 413, "payload_too_large")


def test_guard_stops_reading_at_the_limit() -> None:
    """A body without Content-Length is counted while it streams in: the guard stops pulling
    chunks right after the limit and answers 413 itself."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from mpic.deployments.http.request_guard import GUARD, MULTIPART_ALLOWANCE, RequestGuard

    async def echo(request: Request):
        return JSONResponse({"n": len(await request.body())})

    app = RequestGuard(Starlette(routes=[Route("/v1/files", echo, methods=["POST"])]))
    saved = (GUARD.keys, GUARD.max_upload_bytes)
    GUARD.keys, GUARD.max_upload_bytes = None, 1 << 20
    pulled, sent = 0, []
    chunk = b"\0" * (64 * 1024)

    async def receive():
        nonlocal pulled
        pulled += 1
        return {"type": "http.request", "body": chunk, "more_body": pulled < 16 * 1024}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/files",
        "headers": [],
        "query_string": b"",
        "root_path": "",
    }
    try:
        asyncio.run(app(scope, receive, send))
    finally:
        GUARD.keys, GUARD.max_upload_bytes = saved
    limit = (1 << 20) + MULTIPART_ALLOWANCE
    assert pulled * len(chunk) <= limit + len(chunk)  # of 1 GiB offered, ~1 MiB read
    assert sent[0]["status"] == 413 and len(sent) == 2
    assert b"payload_too_large" in sent[1]["body"]


def test_decompression_bomb_refused_from_header(fake_app) -> None:
    h = fake_app.headers("alice-key")
    for side in (13_000, 5_000):  # 169 M pixels (PIL's bomb bound) and 25 M (> our 16 M)
        data = _png_header(side, side)
        assert len(data) < 200
        t0 = time.perf_counter()
        r = fake_app.client.post(
            "/v1/files",
            headers=h,
            files={"file": ("b.png", data, "image/png")},
            data={"purpose": "vision"},
        )
        _is_error(r, 413, "payload_too_large")
        assert time.perf_counter() - t0 < 1.0
    # inline images go through the same Encoder check
    import base64

    url = "data:image/png;base64," + base64.b64encode(_png_header(13_000, 13_000)).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]
    body = {"model": "mpic", "messages": [{"role": "user", "content": content}]}
    _is_error(fake_app.client.post("/v1/chat/completions", headers=h, json=body), 413)
    ok = fake_app.client.post(
        "/v1/files",
        headers=h,
        files={"file": ("x.png", png(3), "image/png")},
        data={"purpose": "vision"},
    )
    assert ok.status_code == 200, ok.text


def test_request_shape_limits_and_bad_text(tmp_path: Path) -> None:
    limits = {"max_messages": 4, "max_content_parts": 3, "max_text_chars": 1000}
    with _app(tmp_path, limits=limits) as app:
        c, h = app.client, app.headers("alice-key")

        def chat(messages, **extra):
            return c.post(
                "/v1/chat/completions",
                headers=h,
                json={"model": "mpic", "messages": messages, **extra},
            )

        user = {"role": "user", "content": "hi"}
        _is_error(chat([user] * 5), 400)
        parts = [{"type": "text", "text": "a"}] * 4
        _is_error(chat([{"role": "user", "content": parts}]), 400)
        _is_error(chat([{"role": "user", "content": "x " * 600}]), 400, "context_length_exceeded")
        raw = b'{"model": "mpic", "messages": [{"role": "user", "content": "a \\ud800 b"}]}'
        r = c.post(
            "/v1/chat/completions", headers={**h, "content-type": "application/json"}, content=raw
        )
        _is_error(r, 400)
        for policy in ("mpic-9223372036854775808", "mpic-" + "9" * 400):
            _is_error(chat([user], mpic={"policy": policy}), 400)
        assert chat([user]).status_code == 200


def test_admin_refresh_sources_allow_listed(tmp_path: Path, monkeypatch) -> None:
    allowed = tmp_path / "refs"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(png(7))
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "b.png").write_bytes(png(8))
    (allowed / "link").symlink_to(secret)
    opened: list[str] = []
    import mpic.storage.factory as factory

    real = factory.make_object_store
    roots = [str(allowed), "s3://refs-bucket/collections?endpoint=127.0.0.1:1&secure=false"]
    with _app(tmp_path, admin_sources=roots) as app:
        # watched from here on: building the app opens the configured store itself
        monkeypatch.setattr(
            factory, "make_object_store", lambda *a, **k: opened.append(a) or real(*a)
        )
        c, h = app.client, app.headers(ADMIN_KEY)
        calls = []

        class Retriever:  # the refresh itself is tested in tests/retriever; here: what reaches it
            def refresh(self, name, source, captions):
                calls.append(source)
                return {"items": 1}

        app.ingress.retriever = LocalHandle(Retriever())

        def refresh(source, captions=None):
            body = {"source": source} | ({"captions": captions} if captions else {})
            return c.post("/v1/admin/collections/refs/refresh", headers=h, json=body)

        for bad in (
            "s3://evil/x?endpoint=169.254.169.254:80",
            "s3://refs-bucket/collections/x?endpoint=10.0.0.1:9000",  # own endpoint: refused
            "s3://other-bucket/collections",
            "s3://refs-bucket/collectionsX",
            "s3://refs-bucket/collections/../private",
            "http://127.0.0.1:1/",
            str(secret),
            str(allowed / "link"),
            str(allowed / ".." / "secret"),
            "/etc",
            "relative/path",
        ):
            err = _is_error(refresh(bad), 400)
            assert err["param"] == "source"
            assert "127.0.0.1" not in err["message"] and str(tmp_path) not in err["message"]
        _is_error(refresh(str(allowed), captions="/etc/passwd"), 400)
        assert opened == []  # nothing was connected to or listed
        ok = refresh(str(allowed))
        assert ok.status_code == 200, ok.text
        assert calls == [str(allowed)]
        s3 = refresh("s3://refs-bucket/collections/week1")
        assert s3.status_code == 200
        assert calls[-1] == ("s3://refs-bucket/collections/week1?endpoint=127.0.0.1:1&secure=false")
    with _app(tmp_path) as app:  # no roots configured: every HTTP refresh refused
        r = app.client.post(
            "/v1/admin/collections/refs/refresh",
            headers=app.headers(ADMIN_KEY),
            json={"source": str(allowed)},
        )
        _is_error(r, 400)


def _stream_first_chunk(app, text: str):
    body = {
        "model": "mpic",
        "stream": True,
        "max_tokens": 50,
        "messages": [{"role": "user", "content": text}],
    }
    return app.client.stream(
        "POST", "/v1/chat/completions", headers=app.headers("alice-key"), json=body
    )


def test_engine_budget_429_with_retry_after(tmp_path: Path) -> None:
    limits = {"max_requests_in_flight": 2}
    with _app(tmp_path, limits=limits, engine={"fake_token_delay_s": 0.05}) as app:
        words = " ".join(["cat"] * 40)
        started = threading.Barrier(3)
        release = threading.Event()

        def hold():
            with _stream_first_chunk(app, words) as r:
                it = r.iter_lines()
                next(it)
                started.wait()
                release.wait(10)

        threads = [threading.Thread(target=hold) for _ in range(2)]
        for t in threads:
            t.start()
        started.wait(10)
        assert app.worker.budget.stats()["requests_in_flight"] == 2
        t0 = time.perf_counter()
        r = app.client.post(
            "/v1/chat/completions",
            headers=app.headers("bob-key"),
            json={"model": "mpic", "messages": [{"role": "user", "content": "x"}]},
        )
        assert time.perf_counter() - t0 < 1.0
        _is_error(r, 429, "engine_overloaded")
        assert r.headers["retry-after"] == "1"  # no generation timed yet: the 1 s floor
        assert r.headers["retry-after-ms"] == "1000"
        release.set()
        for t in threads:
            t.join(10)
        deadline = time.time() + 5
        while app.worker.budget.stats()["requests_in_flight"] and time.time() < deadline:
            time.sleep(0.05)
        assert app.worker.budget.stats() == {
            "requests_in_flight": 0,
            "tokens_in_flight": 0,
            "budget_rejected": 1,
        }
        ok = app.client.post(
            "/v1/chat/completions",
            headers=app.headers("bob-key"),
            json={"model": "mpic", "messages": [{"role": "user", "content": "x"}]},
        )
        assert ok.status_code == 200


class EngineDeadError(RuntimeError):
    """Named like vLLM v1's error for a dead engine core."""


def test_dead_engine_503_and_unhealthy(fake_app) -> None:
    worker = fake_app.worker
    worker.check_health()  # healthy

    async def dead(prompt, entries):
        raise EngineDeadError("EngineCore encountered an issue. See stack trace for root cause.")
        yield  # pragma: no cover

    worker.engine.generate = dead
    body = {"model": "mpic", "messages": [{"role": "user", "content": "hi"}]}
    for stream in (False, True):
        r = fake_app.client.post(
            "/v1/chat/completions",
            headers=fake_app.headers("alice-key"),
            json={**body, "stream": stream},
        )
        err = _is_error(r, 503, "engine_unavailable")
        assert r.headers["retry-after"] == "5"
        assert "EngineCore" not in err["message"]
    with pytest.raises(RuntimeError, match="engine dead"):
        worker.check_health()


def test_disconnect_closes_engine_generator(fake_app) -> None:
    """The worker's generator, closed after the first token (what Serve does when the client
    goes away), closes the engine's generator at once and releases the budget."""
    from mpic.deployments.messages import LinkedPrompt

    worker = fake_app.worker
    worker.engine.cfg = worker.engine.cfg.model_copy(update={"fake_token_delay_s": 0.05})
    real, closed = worker.engine.generate, []

    async def tracked(prompt, entries):
        produced = 0
        try:
            async for ev in real(prompt, entries):
                produced += 1
                yield ev
        finally:
            closed.append(produced)

    worker.engine.generate = tracked
    captured = {}
    orig = worker.generate

    async def capture(prompt: LinkedPrompt):
        captured["prompt"] = prompt
        async for ev in orig(prompt):
            yield ev

    worker.generate = capture
    body = {"model": "mpic", "max_tokens": 5, "messages": [{"role": "user", "content": "a b c d"}]}
    assert (
        fake_app.client.post(
            "/v1/chat/completions", headers=fake_app.headers("alice-key"), json=body
        ).status_code
        == 200
    )
    prompt = captured["prompt"]
    prompt.max_tokens = 400

    async def abandon() -> float:
        gen = orig(prompt)
        await anext(gen)
        t0 = time.perf_counter()
        await gen.aclose()
        return time.perf_counter() - t0

    took = asyncio.run(abandon())
    assert closed[-1] == 1  # the engine produced one token, then stopped
    assert took < 0.5  # 400 tokens would take seconds: the close did not wait for them
    assert worker.budget.stats()["requests_in_flight"] == 0


def test_error_bodies_carry_no_internals(fake_app) -> None:
    from mpic.storage.object_store import StoreUnavailableError

    h = fake_app.headers("alice-key")
    r = fake_app.client.post(
        "/v1/files",
        headers=h,
        files={"file": ("x.png", b"not an image at all", "image/png")},
        data={"purpose": "vision"},
    )
    err = _is_error(r, 415)
    assert " at 0x" not in err["message"] and "BytesIO" not in err["message"]

    async def unreachable(prompt):
        raise StoreUnavailableError("S3 unreachable on 'mpic/entries/ab12': 10.1.2.3:9000 refused")
        yield  # pragma: no cover

    fake_app.worker.generate = unreachable
    body = {"model": "mpic", "messages": [{"role": "user", "content": "hi"}]}
    r = fake_app.client.post("/v1/chat/completions", headers=h, json=body)
    err = _is_error(r, 503)
    assert r.headers["retry-after"] == "5"
    assert "10.1.2.3" not in err["message"] and "entries" not in err["message"]


def test_vlcache_ratios_longer_than_layers_400(fake_app) -> None:
    fake_app.resolver.num_layers = 2  # as build_app reads it from a 2-layer model's config
    h = fake_app.headers("alice-key")

    def chat(policy: str):
        body = {
            "model": "mpic",
            "mpic": {"policy": policy},
            "messages": [{"role": "user", "content": "hi"}],
        }
        return fake_app.client.post("/v1/chat/completions", headers=h, json=body)

    err = _is_error(chat("vlcache-0.5:0.4:0.3"), 400)
    assert err["param"] == "mpic.policy" and "2-layer" in err["message"]
    assert chat("vlcache-0.5:0.4").status_code == 200


class BackPressureError(RuntimeError):
    """Named like Ray Serve's queue-full error (a deployment past max_queued_requests)."""


def test_serve_backpressure_is_429_json_with_retry_after(fake_app) -> None:
    """Serve's back-pressure on an internal hop (a deployment's queue full) is load, not an
    outage: 429 `engine_overloaded` (OpenAI's rate-limit body) with Retry-After, never 503."""

    async def full(*_a, **_k):
        raise BackPressureError("Request dropped due to backpressure (num_queued_requests=64)")

    fake_app.ingress.resolver = LocalHandle(type("R", (), {"resolve": staticmethod(full)})())
    body = {"model": "mpic", "messages": [{"role": "user", "content": "hi"}]}
    for stream in (False, True):
        r = fake_app.client.post(
            "/v1/chat/completions",
            headers=fake_app.headers("alice-key"),
            json={**body, "stream": stream},
        )
        err = _is_error(r, 429, "engine_overloaded")
        assert err["type"] == "rate_limit_error" and err["param"] is None
        assert r.headers["retry-after"] == "1" and "num_queued" not in err["message"]


@pytest.mark.parametrize(
    ("text", "status", "code"),
    [
        ("Request dropped due to backpressure", 429, "engine_overloaded"),
        ("Service Unavailable", 503, "engine_unavailable"),
    ],
)
def test_serve_plain_text_503_becomes_json(text: str, status: int, code: str) -> None:
    """Ray Serve answers its queue bound itself (a handler it adds to the app: plain text, no
    Retry-After); the guard turns that answer into the OpenAI-style 429 with Retry-After (load),
    and any other plain-text 503 of Serve's into the JSON 503."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from mpic.deployments.http.request_guard import GUARD, RequestGuard

    async def dropped(_request):
        return PlainTextResponse(text, status_code=503)

    app = RequestGuard(Starlette(routes=[Route("/v1/chat/completions", dropped, methods=["POST"])]))
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [],
        "query_string": b"",
        "root_path": "",
    }
    saved, GUARD.keys = GUARD.keys, None
    try:
        asyncio.run(app(scope, receive, send))
    finally:
        GUARD.keys = saved
    assert sent[0]["status"] == status and (b"retry-after", b"1") in sent[0]["headers"]
    import json as _json

    assert _json.loads(sent[1]["body"])["error"]["code"] == code
