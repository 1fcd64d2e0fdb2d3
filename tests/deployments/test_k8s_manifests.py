"""Every k8s manifest parses; serveConfigV2 and deployments/serve_config.yaml resolve to the code:
the import path is the real app builder, the args validate as ServeAppConfig, and every deployment
name they list is one the builder creates."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

from mpic.deployments.config import DEPLOYMENT_NAMES, ServeAppConfig, deployment_options

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "k8s").glob("*.yaml"))


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _serve_configs() -> list[tuple[str, dict]]:
    out = [
        (
            "deployments/serve_config.yaml",
            yaml.safe_load((ROOT / "deployments" / "serve_config.yaml").read_text()),
        )
    ]
    for path in MANIFESTS:
        for doc in _docs(path):
            if doc.get("kind") == "RayService":
                out.append((path.name, yaml.safe_load(doc["spec"]["serveConfigV2"])))
    return out


def test_manifests_parse_and_have_kinds() -> None:
    kinds = {d["kind"] for p in MANIFESTS for d in _docs(p)}
    assert {"RayService", "StatefulSet", "Service", "Secret"} <= kinds
    for path in MANIFESTS:
        for doc in _docs(path):
            assert doc.get("apiVersion") and doc.get("kind"), path


def test_kustomization_lists_every_manifest() -> None:
    kust = yaml.safe_load((ROOT / "k8s" / "kustomization.yaml").read_text())
    listed = set(kust["resources"])
    assert listed == {p.name for p in MANIFESTS} - {"kustomization.yaml"}


def test_rayservice_cluster_shape() -> None:
    (svc,) = [d for p in MANIFESTS for d in _docs(p) if d["kind"] == "RayService"]
    cluster = svc["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["rayVersion"] == importlib.import_module("ray").__version__
    (gpu,) = cluster["workerGroupSpecs"]
    limits = gpu["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 1 and gpu["maxReplicas"] > gpu["minReplicas"]
    secrets = {d["metadata"]["name"] for p in MANIFESTS for d in _docs(p) if d["kind"] == "Secret"}
    for group in [cluster["headGroupSpec"], gpu]:
        container = group["template"]["spec"]["containers"][0]
        refs = [e["secretRef"]["name"] for e in container["envFrom"]]
        assert set(refs) <= secrets


@pytest.mark.parametrize("name,serve_cfg", _serve_configs(), ids=[n for n, _ in _serve_configs()])
def test_serve_config_resolves_to_code(name: str, serve_cfg: dict) -> None:
    (app,) = serve_cfg["applications"]
    module, _, attr = app["import_path"].partition(":")
    builder = getattr(importlib.import_module(module), attr)
    assert callable(builder)
    cfg = ServeAppConfig.model_validate(app["args"])
    listed = [d["name"] for d in app.get("deployments", [])]
    assert sorted(listed) == sorted(DEPLOYMENT_NAMES)
    graph = builder(cfg)
    built = _bound_names(graph)
    assert built == set(DEPLOYMENT_NAMES)
    for key, dep in zip(
        ["ingress", "encoder", "retriever", "resolver", "llm_worker"],
        ["Ingress", "Encoder", "Retriever", "Resolver", "LLMWorker"],
        strict=True,
    ):
        opts = deployment_options(dep, getattr(cfg, key))
        assert opts["autoscaling_config"]["target_ongoing_requests"] > 0
    if name != "deployments/serve_config.yaml":
        assert cfg.llm_worker.num_gpus > 0 and cfg.auth.mode == "production"
        assert cfg.store.url.startswith("s3://")


def _bound_names(app) -> set[str]:
    """Deployment names of a bound application graph (walks the bound constructor args)."""
    seen: set[str] = set()
    stack = [app]
    while stack:
        dep = stack.pop()._bound_deployment
        seen.add(dep.name)
        rc = dep._replica_config
        stack.extend(
            a for a in [*rc.init_args, *rc.init_kwargs.values()] if hasattr(a, "_bound_deployment")
        )
    return seen
