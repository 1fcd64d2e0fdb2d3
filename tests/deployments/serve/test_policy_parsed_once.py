"""A chat's policy is parsed once, by the Resolver (in-process app on the reference engine, no
Ray): the prompt carries the parsed `Policy` to the LLM worker, whose engine serves it without
parsing the name again (counted by wrapping every `get_policy` the package imported); responses
still report the name the request was resolved to. Where the app builder could not read the
model's layer count, the worker checks the parsed policy's layers, still without a parse."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import pytest

from tests.deployments.conftest import ADMIN_KEY, KEYS
from tests.deployments.inprocess import fake_config, in_process_app


@pytest.fixture(scope="module")
def app(tiny_llava_dir: Path, tmp_path_factory):
    cfg = fake_config(
        tmp_path_factory.mktemp("parsed-once") / "store",
        kind="reference",
        model=str(tiny_llava_dir),
        max_tokens_default=3,
    )
    with in_process_app(cfg, KEYS, [ADMIN_KEY]) as running:
        yield running


@pytest.fixture
def parses(monkeypatch) -> list[str]:
    """Every `get_policy` call from here on, as "resolver" (the Resolver's stack) or "worker"
    (anywhere else): each module's imported name is wrapped, not only the registry's."""
    from mpic.linker.policies import registry

    original = registry.get_policy
    seen: list[str] = []

    def counting(*args, **kwargs):
        files = [frame.filename for frame in traceback.extract_stack()]
        where = "resolver" if any(f.endswith("serve/resolver.py") for f in files) else "worker"
        seen.append(where)
        return original(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("mpic.") and getattr(module, "get_policy", None) is original:
            monkeypatch.setattr(module, "get_policy", counting)
    return seen


def _chat(app, policy: str | None) -> dict:
    body: dict = {
        "model": "mpic",
        "max_tokens": 3,
        "messages": [{"role": "user", "content": "Describe the weather in one word."}],
    }
    if policy is not None:
        body["mpic"] = {"policy": policy}
    resp = app.client.post("/v1/chat/completions", json=body, headers=app.headers("alice-key"))
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.parametrize("policy", ["mpic-4", "auto", "scout-0.3:k2", "vlcache-0.5", None])
def test_one_parse_in_the_resolver_none_in_the_worker(app, parses, policy) -> None:
    answer = _chat(app, policy)
    assert parses == ["resolver"]
    want = policy or app.config.default_policy
    assert answer["mpic"]["policy"] == want  # the name as resolved, as before


def test_the_worker_checks_the_parsed_policys_layers_without_a_parse(app, parses) -> None:
    from mpic.deployments.serve.policy_check import model_layers

    layers = model_layers(app.config.engine)
    assert layers is not None
    saved = app.resolver.num_layers, app.worker.policy_layers
    app.resolver.num_layers, app.worker.policy_layers = None, layers  # the builder could not
    try:
        _chat(app, "vlcache-0.5:0.4")
        too_many = "vlcache-" + ":".join(["0.5"] * (layers + 1))
        resp = app.client.post(
            "/v1/chat/completions",
            json={
                "model": "mpic",
                "mpic": {"policy": too_many},
                "messages": [{"role": "user", "content": "hi"}],
            },
            headers=app.headers("alice-key"),
        )
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "mpic.policy"
        assert f"for a {layers}-layer model" in resp.json()["error"]["message"]
    finally:
        app.resolver.num_layers, app.worker.policy_layers = saved
    assert parses == ["resolver", "resolver"]
