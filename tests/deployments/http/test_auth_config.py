"""API keys (env, keys file, dev mode, production without keys), OpenAI error bodies, and the
app config -> `serve.deployment` options mapping. Fast: no Ray cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel, ValidationError

from mpic.deployments.config import AuthConfig, ServeAppConfig, load_config
from mpic.deployments.deployment_config import DeploymentConfig, deployment_options
from mpic.deployments.http.auth import DEV_ADMIN_KEY, DEV_KEYS, KeyRing
from mpic.deployments.http.http_errors import install_error_handlers
from mpic.errors import (
    AuthenticationError,
    ExpiredError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    UnreadableMediaError,
)

ROOT = Path(__file__).resolve().parents[3]


def test_production_mode_has_no_builtin_keys() -> None:
    ring = KeyRing.from_config(AuthConfig(mode="production"), env={})
    assert len(ring) == 0
    for key in [*DEV_KEYS, DEV_ADMIN_KEY]:
        with pytest.raises(AuthenticationError):
            ring.authenticate(f"Bearer {key}")


def test_env_keys_map_users_and_admins() -> None:
    env = {
        "MPIC_API_KEYS": json.dumps({"k-a": "alice", "k-b": "bob"}),
        "MPIC_ADMIN_KEYS": json.dumps(["k-root"]),
    }
    ring = KeyRing.from_config(AuthConfig(), env=env)
    assert ring.authenticate("Bearer k-a").user == "alice"
    assert not ring.authenticate("bearer k-b").is_admin
    root = ring.authenticate("Bearer k-root")
    assert root.is_admin and root.user == "admin"
    KeyRing.require_admin(root)
    with pytest.raises(PermissionDeniedError):
        KeyRing.require_admin(ring.authenticate("Bearer k-a"))
    for header in [None, "", "Basic k-a", "Bearer nope", "Bearer k-a2"]:
        with pytest.raises(AuthenticationError):
            ring.authenticate(header)


def test_keys_file_and_dev_mode(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("api_keys: {file-key: carol}\nadmin_keys: [file-admin]\n")
    ring = KeyRing.from_config(AuthConfig(mode="dev", keys_file=str(path)), env={})
    assert ring.authenticate("Bearer file-key").user == "carol"
    assert ring.authenticate("Bearer file-admin").is_admin
    for dev in ["mpic-dev-alice", "mpic-dev-bob", DEV_ADMIN_KEY]:  # keys configured: closed
        with pytest.raises(AuthenticationError):
            ring.authenticate(f"Bearer {dev}")
    ring = KeyRing.from_config(AuthConfig(mode="dev"), env={})  # nothing configured: dev keys
    assert ring.authenticate("Bearer mpic-dev-alice").user == "alice"
    assert ring.authenticate(f"Bearer {DEV_ADMIN_KEY}").is_admin
    env = {"MPIC_API_KEYS": '{"k": "u"}'}
    with pytest.raises(AuthenticationError):
        KeyRing.from_config(AuthConfig(mode="dev"), env=env).authenticate(f"Bearer {DEV_ADMIN_KEY}")


@pytest.mark.parametrize(
    "env",
    [
        {"MPIC_API_KEYS": "not json"},
        {"MPIC_API_KEYS": "[1]"},
        {"MPIC_ADMIN_KEYS": '{"a": 1}'},
        {"MPIC_API_KEYS": '{"k": ""}'},
    ],
)
def test_bad_key_config_is_a_typed_error(env: dict) -> None:
    with pytest.raises(InvalidRequestError):
        KeyRing.from_config(AuthConfig(), env=env)


class _Body(BaseModel):
    n: int


def _error_app() -> TestClient:
    app = FastAPI()
    install_error_handlers(app)
    errors = {
        "401": AuthenticationError("no key"),
        "403": PermissionDeniedError("admin"),
        "404": NotFoundError("nope", param="file_id"),
        "410": ExpiredError("gone"),
        "413": PayloadTooLargeError("big"),
        "415": UnreadableMediaError("not an image"),
        "400": InvalidRequestError("bad policy"),
    }

    @app.get("/raise/{code}")
    def _raise(code: str) -> None:
        raise errors[code]

    @app.post("/body")
    def _body(body: _Body) -> dict:
        return {"n": body.n}

    return TestClient(app)


@pytest.mark.parametrize("code", ["400", "401", "403", "404", "410", "413", "415"])
def test_typed_errors_map_to_openai_bodies(code: str) -> None:
    resp = _error_app().get(f"/raise/{code}")
    assert resp.status_code == int(code)
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (resp.headers.get("www-authenticate") == "Bearer") == (code == "401")


def test_malformed_body_is_400_naming_the_field() -> None:
    resp = _error_app().post("/body", json={"n": "x"})
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "invalid_request_error"
    assert resp.json()["error"]["param"] == "n"


def test_deployment_options_use_target_ongoing_requests() -> None:
    cfg = DeploymentConfig(
        num_cpus=0.25,
        num_gpus=1,
        max_ongoing_requests=5,
        autoscaling={"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 1.5},
    )
    opts = deployment_options("LLMWorker", cfg)
    assert opts["ray_actor_options"] == {"num_cpus": 0.25, "num_gpus": 1}
    auto = opts["autoscaling_config"]
    assert auto["target_ongoing_requests"] == 1.5 and auto["max_replicas"] == 3
    assert "target_num_ongoing_requests_per_replica" not in auto
    from ray.serve.config import AutoscalingConfig

    AutoscalingConfig(**auto)  # Ray accepts every key
    bad = DeploymentConfig(autoscaling={"min_replicas": 3, "max_replicas": 2})
    with pytest.raises(InvalidRequestError):
        deployment_options("Resolver", bad)


def test_load_config_variants(tmp_path: Path) -> None:
    assert load_config(None).auth.mode == "dev"
    shipped = load_config(ROOT / "deployments" / "serve_config.yaml")
    assert shipped.engine.kind == "reference" and shipped.sweep_interval_s == 300
    bare = tmp_path / "bare.yaml"
    bare.write_text("engine: {kind: reference, model: /m}\nauth: {mode: production}\n")
    assert load_config(bare).engine.model == "/m"
    bare.write_text("engine: {kind: nope}\n")
    with pytest.raises(ValidationError):
        load_config(bare)
    with pytest.raises(InvalidRequestError):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ValidationError):
        ServeAppConfig(unknown_field=1)


def test_serve_command_rejects_a_bad_config(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from mpic.cli import app

    bad = tmp_path / "bad.yaml"
    bad.write_text("engine: {kind: tensorrt}\n")
    for path in [bad, tmp_path / "missing.yaml"]:
        result = CliRunner().invoke(app, ["serve", "--config", str(path)])
        assert result.exit_code == 2 and "bad config" in result.output


def test_shipped_serve_config_deployments_section_is_serves_schema() -> None:
    """The per-deployment options live in Serve's own `deployments:` section (Serve validates
    it; `mpic serve --config` applies it over `args` through `build_app`)."""
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from mpic.cli.serve import serve_overrides
    from mpic.deployments.app import build_app

    path = ROOT / "deployments" / "serve_config.yaml"
    ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    overrides = serve_overrides(str(path))
    assert overrides["LLMWorker"]["ray_actor_options"] == {"num_cpus": 0.5}
    # left to the app builder: the engine budget, not Serve's queue, refuses first
    assert "max_ongoing_requests" not in overrides["LLMWorker"]
    graph = build_app(load_config(path), overrides)
    opts = graph._bound_deployment._deployment_config
    assert opts.autoscaling_config.max_replicas == 2  # the Ingress override
    # no override given: the args default, raised to limits.max_pending_requests so the
    # ingress's own TTFT admission sheds before Serve's proxy (mpic.deployments.http.shedding)
    assert opts.max_ongoing_requests == 1024
    pinned = build_app(load_config(path), {"Ingress": {"num_replicas": 3}})
    assert pinned._bound_deployment._deployment_config.num_replicas == 3
