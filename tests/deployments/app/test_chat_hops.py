"""A chat's Ray hops (fast, no Ray): every deployment-handle call the application makes for one
chat, counted through the in-process harness's handles (`tests/deployments/inprocess.py`), whose
ingress, resolver and worker are the Serve classes themselves. A chat is two hops, Ingress ->
Resolver.resolve and Ingress -> LLMWorker.generate: the policy is checked where the request is
resolved, against the model's layer count bound in at build time (`build_app`), never by asking
the worker. A bad policy is a 400 after one hop, the worker untouched."""

from __future__ import annotations

import json

import pytest

from tests.deployments.conftest import png

TWO_HOPS = [("Resolver", "resolve"), ("LLMWorker", "generate")]


def _chat(app, content, stream: bool = False, **mpic):
    body = {"model": "mpic", "messages": [{"role": "user", "content": content}], "stream": stream}
    if mpic:
        body["mpic"] = mpic
    r = app.client.post("/v1/chat/completions", headers=app.headers("alice-key"), json=body)
    return r


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "mpic",
    [{}, {"policy": "mpic-4"}, {"policy": "auto"}, {"recompute_budget": 0.3}],
    ids=["default", "named", "auto", "budget"],
)
def test_a_chat_is_two_ray_hops(fake_app, stream: bool, mpic: dict) -> None:
    upload = fake_app.client.post(
        "/v1/files",
        headers=fake_app.headers("alice-key"),
        files={"file": ("a.png", png(3), "image/png")},
        data={"purpose": "vision"},
    )
    assert upload.status_code == 200, upload.text
    file_id = upload.json()["id"]
    content = [{"type": "file", "file": {"file_id": file_id}}, {"type": "text", "text": "hi"}]
    for turn in ("hi there", content):
        fake_app.calls.clear()
        r = _chat(fake_app, turn, stream=stream, **mpic)
        assert r.status_code == 200, r.text
        if stream:
            assert r.text.rstrip().endswith("data: [DONE]")
        assert fake_app.calls == TWO_HOPS, fake_app.calls


@pytest.mark.parametrize("policy", ["magic", "mpic-" + "9" * 5000, "vlcache-0.5:0.4:0.3"])
def test_a_bad_policy_is_one_hop_and_400(fake_app, policy: str) -> None:
    fake_app.resolver.num_layers = 2  # as build_app reads it from a 2-layer model's config
    fake_app.calls.clear()
    r = _chat(fake_app, "hi", policy=policy)
    assert r.status_code == 400, r.text
    assert json.loads(r.text)["error"]["param"] == "mpic.policy"
    assert fake_app.calls == [("Resolver", "resolve")]


def test_the_resolver_is_bound_with_the_layer_count_and_no_worker(tiny_llava_dir) -> None:
    """In the Serve graph `build_app` binds, the Resolver gets the model's layer count (read from
    its config.json) and holds no LLM-worker handle, so it cannot make the third hop."""
    from mpic.deployments.app import build_app
    from mpic.deployments.config import ServeAppConfig

    cfg = ServeAppConfig.model_validate(
        {"engine": {"kind": "reference", "model": str(tiny_llava_dir)}}
    )
    ingress = build_app(cfg)._bound_deployment
    bound = {
        a._bound_deployment.name: a for a in ingress.init_args if hasattr(a, "_bound_deployment")
    }
    resolver = bound["Resolver"]._bound_deployment
    handles = [
        a._bound_deployment.name for a in resolver.init_args if hasattr(a, "_bound_deployment")
    ]
    assert handles == ["Retriever"]  # inline images: the Ingress asks the Encoder
    assert resolver.init_args[-1] == 2  # the tiny LLaVA's layers
    assert bound["LLMWorker"]._bound_deployment.init_kwargs == {"check_policy_layers": False}


def test_the_worker_checks_the_layers_when_the_builder_could_not(fake_app, tmp_path) -> None:
    """A model folder the app builder cannot read (on the GPU nodes only): the Resolver is bound
    without a layer count and the LLM worker with `check_policy_layers`; per-layer ratios are
    then refused by the worker's generate, still a 400 in two hops."""
    from mpic.deployments.app import build_app
    from mpic.deployments.config import ServeAppConfig

    missing = str(tmp_path / "on-the-gpu-nodes")
    cfg = ServeAppConfig.model_validate({"engine": {"kind": "reference", "model": missing}})
    ingress = build_app(cfg)._bound_deployment
    bound = {
        a._bound_deployment.name: a for a in ingress.init_args if hasattr(a, "_bound_deployment")
    }
    assert bound["Resolver"]._bound_deployment.init_args[-1] is None
    assert bound["LLMWorker"]._bound_deployment.init_kwargs == {"check_policy_layers": True}

    fake_app.worker.policy_layers = 2  # as that worker reads it from its own model folder
    fake_app.calls.clear()
    r = _chat(fake_app, "hi", policy="vlcache-0.5:0.4:0.3")
    assert r.status_code == 400, r.text
    assert json.loads(r.text)["error"]["param"] == "mpic.policy"
    assert fake_app.calls == TWO_HOPS
    assert _chat(fake_app, "hi", policy="vlcache-0.5:0.4").status_code == 200
