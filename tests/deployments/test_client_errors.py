"""Client errors (4xx) cross a Serve hop as values (`mpic.deployments.client_errors`): a replica
method answers a `ClientError` instead of raising (sync, async, streamed, and passed on when a
chained argument is one), the caller's handle raises it again, 5xx and untyped errors are raised
as before. Through the in-process app: bad inputs of every kind raised in a replica answer the
same JSON 4xx, each logged as one INFO line with its request id and no ERROR or traceback.
`BAD_KINDS` is also what `app/test_serve_stop.py` sends through Ray Serve, where Serve's own
replica logging is observed."""

from __future__ import annotations

import asyncio
import base64
import logging
from pathlib import Path

import pytest

from mpic.deployments.client_errors import (
    ClientError,
    answering_client_errors,
    raise_client_error,
    raising,
)
from mpic.deployments.serve.admission import EngineUnavailableError
from mpic.errors import NotFoundError
from tests.deployments.conftest import ADMIN_KEY, KEYS
from tests.deployments.inprocess import LocalHandle, fake_config, in_process_app

MAX_UPLOAD = 64 * 1024


class Replica:
    def lookup(self, kind: str) -> str:
        return self._check(kind)

    async def alookup(self, kind: str) -> str:
        return self._check(kind)

    async def stream(self, kind: str):
        yield "a"
        yield "b"
        self._check(kind)
        yield "c"

    def check_health(self) -> None:
        raise NotFoundError("a Serve hook is left as it is")

    @staticmethod
    def _check(kind: str) -> str:
        if kind == "missing":
            raise NotFoundError("no such thing", param="id")
        if kind == "down":
            raise EngineUnavailableError("engine gone", retry_after=5)
        if kind == "bug":
            raise ValueError("bug")
        return kind


def test_replica_answers_client_errors_as_values_and_the_handle_raises_them() -> None:
    obj = answering_client_errors(Replica)()
    assert type(obj).__name__ == "Replica" and isinstance(obj, Replica)
    got = obj.lookup("missing")
    assert isinstance(got, ClientError) and got.error.status == 404 and got.error.param == "id"
    assert obj.lookup("ok") == "ok"
    assert isinstance(asyncio.run(obj.alookup("missing")), ClientError)
    for kind, exc in (("down", EngineUnavailableError), ("bug", ValueError)):
        with pytest.raises(exc):  # a 5xx or an untyped error: raised, Serve logs it
            obj.lookup(kind)
    assert obj.lookup(ClientError(NotFoundError("x"))).error.message == "x"  # chained: passed on
    with pytest.raises(NotFoundError):
        obj.check_health()

    async def items(handle, kind):
        return [x async for x in handle.options(stream=True).stream.remote(kind)]

    plain, wrapped = LocalHandle(obj), raising(LocalHandle(obj))
    assert asyncio.run(items(plain, "missing"))[:2] == ["a", "b"]  # the value, last
    assert isinstance(asyncio.run(items(plain, "missing"))[-1], ClientError)
    assert asyncio.run(items(wrapped, "ok")) == ["a", "b", "c"]
    with pytest.raises(NotFoundError, match="no such thing"):
        asyncio.run(items(wrapped, "missing"))

    async def call(kind):
        return await wrapped.alookup.remote(wrapped.lookup.remote(kind))  # a chained response

    assert asyncio.run(call("ok")) == "ok"
    with pytest.raises(NotFoundError):
        asyncio.run(call("missing"))
    with pytest.raises(NotFoundError):
        raise_client_error(obj.lookup("missing"))


def _chat(content, **body) -> dict:
    return {"model": "mpic", "messages": [{"role": "user", "content": content}], **body}


def _b64(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _file(file_id: str) -> list:
    return [{"type": "file", "file": {"file_id": file_id}}]


CHAT = "/v1/chat/completions"


def _bad(kind, where, status, body=None, method="POST", path=CHAT, **kwargs) -> tuple:
    if body is not None:
        kwargs["json"] = body
    return kind, where, status, method, path, kwargs


def _inline(data: bytes) -> dict:
    return _chat([{"type": "image_url", "image_url": {"url": _b64(data)}}])


BAD_KINDS: list[tuple] = [  # (kind, where it is raised, status, method, path, httpx kwargs)
    _bad("unknown file id", "Resolver", 404, _chat(_file("file-0"))),
    _bad("unknown file id, streamed", "Resolver", 404, _chat(_file("file-1"), stream=True)),
    _bad("bad policy", "Resolver", 400, _chat("hi", mpic={"policy": "x-7"})),
    _bad("5,000-digit policy", "Resolver", 400, _chat("hi", mpic={"policy": "mpic-" + "9" * 5000})),
    _bad(
        "remote image URL",
        "Resolver",
        400,
        _chat([{"type": "image_url", "image_url": {"url": "http://h/x.png"}}]),
    ),
    _bad("inline image over the upload limit", "Resolver", 413, _inline(b"x" * (MAX_UPLOAD + 1))),
    _bad(
        "inline bytes not an image",
        "Encoder, raised in the LLM worker",
        415,
        _inline(b"no image" * 9),
    ),
    _bad("prompt over the context", "LLM worker's engine", 400, _chat("w " * 5000)),
    _bad(
        "upload not an image",
        "Encoder, chained into LLMWorker.upload",
        415,
        path="/v1/files",
        files={"file": ("x.png", b"no image", "image/png")},
        data={"purpose": "vision"},
    ),
    _bad("retrieval auto, no collection", "Resolver", 400, _chat("hi", mpic={"retrieval": "auto"})),
    _bad(
        "retrieval, unknown collection",
        "Retriever, via the Resolver",
        404,
        _chat("hi", mpic={"retrieval": {"collection": "nope", "top_k": 2}}),
    ),
    _bad(
        "admin: unknown collection",
        "Retriever",
        404,
        method="GET",
        path="/v1/admin/collections/nope/versions",
    ),
    _bad(
        "malformed JSON",
        "Ingress",
        400,
        content=b'{"model": "mpic", "messages": [',
        headers={"Content-Type": "application/json"},
    ),
    _bad("unknown field", "Ingress", 400, _chat("hi", bogus=1)),
    _bad("unknown model", "Ingress", 404, {**_chat("hi"), "model": "m"}),
    _bad("unknown file id, retrieve", "Ingress", 404, method="GET", path="/v1/files/file-2"),
]


def bad_requests(n: int, key: str, admin_key: str):
    """`n` bad requests cycling through `BAD_KINDS`: (request id, kind, status, method, path,
    httpx keyword arguments with the key's Authorization header and an X-Request-ID)."""
    for i in range(n):
        kind, _, status, method, path, kwargs = BAD_KINDS[i % len(BAD_KINDS)]
        kwargs = dict(kwargs)
        who = admin_key if path.startswith("/v1/admin") else key
        rid = f"bad-{i}"
        kwargs["headers"] = {
            **kwargs.get("headers", {}),
            "Authorization": f"Bearer {who}",
            "X-Request-ID": rid,
        }
        yield rid, kind, status, method, path, kwargs


def check_answer(response, kind: str, status: int) -> None:
    """A bad request's answer: its status, with OpenAI's JSON error body."""
    assert response.status_code == status, (kind, response.status_code, response.text[:300])
    assert response.headers["content-type"].startswith("application/json"), kind
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}, kind


def test_bad_inputs_answer_4xx_json_each_logged_once_without_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = fake_config(tmp_path / "store")
    cfg = cfg.model_copy(
        update={"limits": cfg.limits.model_copy(update={"max_upload_bytes": MAX_UPLOAD})}
    )
    caplog.set_level(logging.INFO)
    n = 2 * len(BAD_KINDS)
    with in_process_app(cfg, KEYS, [ADMIN_KEY]) as app:
        for _, kind, status, method, path, kwargs in bad_requests(n, "alice-key", ADMIN_KEY):
            check_answer(app.client.request(method, path, **kwargs), kind, status)
        assert app.client.get("/healthz").status_code == 200
    loud = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not loud, [r.getMessage()[:200] for r in loud]
    answered = [r.getMessage() for r in caplog.records if " answered 4" in r.getMessage()]
    for i in range(n):
        assert sum(m.startswith(f"request bad-{i} answered") for m in answered) == 1, i
