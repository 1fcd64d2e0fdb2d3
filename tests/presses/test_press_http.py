"""The `mpic` request extension's press/budget over HTTP on the REAL reference engine (tiny
LLaVA, in-process, no Ray): the answer equals the offline runner's under the same press; an
unknown press or a budget outside (0, 1] is a 400 naming the field; an engine that cannot
compress rejects a press with a 400 (honoured or rejected, never ignored); the server's
default press applies when the request names none."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from tests.deployments.conftest import ADMIN_KEY, KEYS, png
from tests.deployments.inprocess import fake_config, in_process_app

POLICY = "mpic-4"


def _err(resp, param: str) -> dict:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    return err


def _body(fid: str, mpic: dict) -> dict:
    content = [
        {"type": "text", "text": "look"},
        {"type": "file", "file": {"file_id": fid}},
        {"type": "text", "text": "and describe it"},
    ]
    return {
        "model": "mpic",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "mpic": mpic,
    }


def _upload(app) -> str:
    resp = app.client.post(
        "/v1/files",
        files={"file": ("a.png", io.BytesIO(png(7)), "image/png")},
        data={"purpose": "vision"},
        headers=app.headers("alice-key"),
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["id"]


@pytest.fixture(scope="module")
def offline(tiny_llava_dir: Path):
    from mpic.engine.hf.reference_runner import ReferenceRunner

    return ReferenceRunner(str(tiny_llava_dir))


def _offline_answer(offline, press, budget) -> str:
    from mpic.prompt_parts import ImageRef

    ref = ImageRef(offline.cache_image(png(7)).entry_id)
    gen = offline.generate(["look", ref, "and describe it"], POLICY, 6, press=press, budget=budget)
    return offline.processor.tokenizer.decode(gen.tokens, skip_special_tokens=True)


@pytest.mark.parametrize("default", [None, "meda"])
def test_press_over_http_equals_offline_and_bad_values_are_400(
    tiny_llava_dir, tmp_path_factory, offline, default
) -> None:
    cfg = fake_config(tmp_path_factory.mktemp("press"), kind="reference", model=str(tiny_llava_dir))
    if default:
        cfg.default_press, cfg.default_budget = default, 0.3
    with in_process_app(cfg, KEYS, [ADMIN_KEY]) as app:
        fid, h = _upload(app), app.headers("alice-key")
        post = app.client.post
        for press, budget in (("snapkv", 0.3), ("elastic", 0.2)):
            resp = post(
                "/v1/chat/completions",
                json=_body(fid, {"policy": POLICY, "press": press, "budget": budget}),
                headers=h,
            )
            assert resp.status_code == 200, resp.text
            got = resp.json()["choices"][0]["message"]["content"]
            assert got == _offline_answer(offline, press, budget)
        resp = post("/v1/chat/completions", json=_body(fid, {"policy": POLICY}), headers=h)
        assert resp.json()["choices"][0]["message"]["content"] == _offline_answer(
            offline, default, 0.3 if default else None
        )
        _err(post("/v1/chat/completions", json=_body(fid, {"press": "h2o"}), headers=h),
             "mpic.press")  # fmt: skip
        for bad in (0, -0.5, 1.5):
            body = _body(fid, {"press": "meda", "budget": bad})
            _err(post("/v1/chat/completions", json=body, headers=h), "mpic.budget")


def test_engine_without_presses_rejects_a_press(tmp_path_factory) -> None:
    cfg = fake_config(tmp_path_factory.mktemp("press-fake"))
    with in_process_app(cfg, KEYS, [ADMIN_KEY]) as app:
        h = app.headers("alice-key")
        body = {
            "model": "mpic",
            "messages": [{"role": "user", "content": "hi"}],
            "mpic": {"press": "meda", "budget": 0.3},
        }
        err = _err(app.client.post("/v1/chat/completions", json=body, headers=h), "mpic.press")
        assert "reference engine" in err["message"]
        body["mpic"] = {"press": "meda", "budget": 1.0}  # budget 1.0 compresses nothing
        assert app.client.post("/v1/chat/completions", json=body, headers=h).status_code == 200
