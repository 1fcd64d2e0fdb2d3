"""The fake engine and the in-process harness (no Ray, no model): the engine registry takes
built-in names and class paths, the fake engine is deterministic and honours its sampling
fields, and a cached file's tokens are reported as cached over HTTP."""

from __future__ import annotations

import pytest

from tests.deployments.conftest import png


def test_registry_names_and_class_paths(tmp_path) -> None:
    from mpic.deployments.config import engine_config
    from mpic.deployments.engines.engine import build_engine
    from mpic.deployments.engines.fake_engine import FakeServeEngine
    from mpic.errors import InvalidRequestError
    from mpic.storage.config import StorageConfig

    store = StorageConfig(url=tmp_path.as_uri())
    for kind in ("fake", "mpic.deployments.engines.fake_engine:FakeServeEngine"):
        assert isinstance(build_engine(engine_config(kind=kind), store, "worker"), FakeServeEngine)
    with pytest.raises(InvalidRequestError, match="not a ServeEngine"):
        build_engine(engine_config(kind="mpic.deployments.config:EngineConfig"), store, "worker")
    with pytest.raises(InvalidRequestError, match="engine.kind"):
        build_engine(engine_config(kind="mpic.nowhere:Engine"), store, "worker")
    with pytest.raises(ValueError):
        engine_config(kind="not a path")


def test_cached_file_over_http(fake_app) -> None:
    from mpic.deployments.engines.fake_engine import fake_tokens

    c, h = fake_app.client, fake_app.headers("alice-key")
    data = png(1)
    r = c.post(
        "/v1/files",
        headers=h,
        files={"file": ("x.png", data, "image/png")},
        data={"purpose": "vision"},
    )
    assert r.status_code == 200, r.text
    fid = r.json()["id"]
    assert r.json()["tokens"] == fake_tokens(data)
    content = [{"type": "file", "file": {"file_id": fid}}, {"type": "text", "text": "red cat"}]
    body = {"model": "mpic", "messages": [{"role": "user", "content": content}]}
    r = c.post("/v1/chat/completions", headers=h, json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["message"]["content"] == "red cat"
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == fake_tokens(data)
    assert out["usage"]["prompt_tokens"] == 4 + fake_tokens(data) + 2
