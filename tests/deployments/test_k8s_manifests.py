"""The k8s manifests render and validate offline, and their Serve config resolves to the code.

- Rendering: a documented subset of kustomize (`resources`, `images` with `configurations`
  field specs, `secretGenerator` from env files, `generatorOptions`) implemented here; when
  `kubectl` is installed, `kubectl kustomize` renders the same objects.
- Validation: the RayService against the `v1` openAPIV3Schema of KubeRay's CRD (v1.7.0), with
  unknown fields rejected (the API server prunes them: a field the CRD does not know is dead);
  Secret, Service and StatefulSet against Kubernetes 1.33's strict JSON schemas. Both are vendored
  in tests/deployments/schemas/ (vendor.py says from where).
- serveConfigV2 and deployments/serve_config.yaml: the import path is the real app builder, the
  args validate as ServeAppConfig, and every deployment name they list is one the builder creates.
"""

from __future__ import annotations

import base64
import copy
import importlib
import json
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from mpic.deployments.config import ServeAppConfig
from mpic.deployments.deployment_config import DEPLOYMENT_NAMES, deployment_options

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
SCHEMAS = Path(__file__).parent / "schemas"
UPGRADE_TYPES = {"NewCluster", "NewClusterWithIncrementalUpgrade", "None"}  # KubeRay v1.7 API
DEAD_FIELDS = {"serviceUnhealthySecondThreshold", "deploymentUnhealthySecondThreshold"}
# kustomize's built-in image field specs (any kind); `configurations:` adds per-kind ones.
BUILTIN_IMAGE_PATHS = [
    "spec/containers[]/image",
    "spec/initContainers[]/image",
    "spec/template/spec/containers[]/image",
    "spec/template/spec/initContainers[]/image",
]


# --- a kustomize subset ---------------------------------------------------------------------


def _env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (comments and blank lines skipped), as kustomize reads `envs:` files."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path}: not KEY=VALUE: {line!r}"
            out[key] = value
    return out


def _set_images(node: object, parts: list[str], images: dict[str, dict]) -> None:
    """Rewrite the image at `parts` (kustomize field-spec path, `[]` = every list item)."""
    if not parts or not isinstance(node, dict):
        return
    key, rest = parts[0], parts[1:]
    if key.endswith("[]"):
        for item in node.get(key[:-2]) or []:
            _set_images(item, rest, images)
    elif not rest:
        if isinstance(node.get(key), str):
            name, _, tag = node[key].partition(":")
            if name in images:
                new = images[name]
                node[key] = f"{new.get('newName', name)}:{new.get('newTag', tag)}".rstrip(":")
    else:
        _set_images(node.get(key), rest, images)


def render(folder: Path) -> list[dict]:
    """The objects `kubectl kustomize folder` would emit, for the fields this project uses."""
    kust = yaml.safe_load((folder / "kustomization.yaml").read_text())
    known = {
        "apiVersion", "kind", "resources", "images", "configurations",
        "generatorOptions", "secretGenerator",
    }  # fmt: skip
    assert set(kust) <= known, f"kustomization uses fields this subset lacks: {set(kust) - known}"
    objs = [d for r in kust["resources"] for d in yaml.safe_load_all((folder / r).read_text()) if d]
    opts = kust.get("generatorOptions", {})
    assert opts.get("disableNameSuffixHash") is True, "name hashes are not rewritten in CRs"
    for gen in kust.get("secretGenerator", []):
        data = {}
        for env in gen["envs"]:
            data.update(_env_file(folder / env))
        meta = {"name": gen["name"], "labels": dict(opts.get("labels", {}))}
        objs.insert(0, {
            "apiVersion": "v1", "kind": "Secret", "type": gen.get("type", "Opaque"),
            "metadata": meta,
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
        })  # fmt: skip
    extra = [
        fs
        for c in kust.get("configurations", [])
        for fs in yaml.safe_load((folder / c).read_text()).get("images", [])
    ]
    images = {i["name"]: i for i in kust.get("images", [])}
    for obj in objs:
        paths = BUILTIN_IMAGE_PATHS + [fs["path"] for fs in extra if fs["kind"] == obj["kind"]]
        for path in paths:
            _set_images(obj, path.split("/"), images)
    return objs


def _by_name(objs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """k8s/ rendered with the example secret files standing in for the git-ignored real ones."""
    folder = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, folder)
    for example in (folder / "secrets").glob("*.env.example"):
        shutil.copy(example, example.with_suffix(""))
    return render(folder)


@pytest.fixture(scope="module")
def rayservice(rendered: list[dict]) -> dict:
    (svc,) = [o for o in rendered if o["kind"] == "RayService"]
    return svc


def test_kubectl_kustomize_agrees_with_the_subset(rendered: list[dict], tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: the subset renderer alone is checked")
    folder = tmp_path / "k8s"
    shutil.copytree(K8S, folder)
    for example in (folder / "secrets").glob("*.env.example"):
        shutil.copy(example, example.with_suffix(""))
    out = subprocess.run(
        [kubectl, "kustomize", str(folder)], capture_output=True, text=True, check=True
    ).stdout
    real = _by_name([d for d in yaml.safe_load_all(out) if d])
    assert real == _by_name(rendered)


def test_no_committed_secrets() -> None:
    """Secret values come only from git-ignored env files (a fresh clone has none, so
    `kubectl apply -k` fails instead of applying placeholders)."""
    ignored = (K8S / "secrets" / ".gitignore").read_text().split()
    assert "*.env" in ignored
    for path in K8S.glob("*.yaml"):
        assert "REPLACE_ME" not in path.read_text(), path
        for doc in yaml.safe_load_all(path.read_text()):
            assert not doc or doc.get("kind") != "Secret", f"{path}: committed Secret"


# --- schema validation --------------------------------------------------------------------


def _crd_to_jsonschema(node: object) -> object:
    """openAPIV3Schema (structural, as the API server applies it) -> JSON Schema: `nullable`
    becomes a null type, and objects with `properties` reject unknown fields unless they
    preserve them (the server would prune them silently)."""
    if isinstance(node, list):
        return [_crd_to_jsonschema(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _crd_to_jsonschema(v) for k, v in node.items()}
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    if (
        "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def crd_validator() -> jsonschema.protocols.Validator:
    schema = json.loads((SCHEMAS / "rayservice-v1-kuberay-v1.7.0.json").read_text())
    return jsonschema.Draft7Validator(_crd_to_jsonschema(schema))


@pytest.fixture(scope="module")
def k8s_schemas() -> dict:
    return json.loads((SCHEMAS / "k8s-v1.33.0-strict.json").read_text())


def _errors(validator: jsonschema.protocols.Validator, obj: dict) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)
    ]


def test_rayservice_validates_against_the_kuberay_crd(crd_validator, rayservice) -> None:
    assert _errors(crd_validator, rayservice) == []


def test_crd_validation_catches_unknown_and_mistyped_fields(crd_validator, rayservice) -> None:
    bad = copy.deepcopy(rayservice)
    bad["spec"]["rayClusterConfig"]["enableInTreeAutoscalng"] = True  # typo: pruned by the server
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] = "four"
    errors = _errors(crd_validator, bad)
    assert any("enableInTreeAutoscalng" in e for e in errors), errors
    assert any("maxReplicas" in e for e in errors), errors


def test_core_objects_validate_against_kubernetes_schemas(k8s_schemas, rendered) -> None:
    core = [o for o in rendered if o["kind"] != "RayService"]
    assert {o["kind"] for o in core} == {"Secret", "Service", "StatefulSet"}
    for obj in core:
        ref = k8s_schemas["kinds"][f"{obj['apiVersion']}/{obj['kind']}"]
        schema = {"$ref": f"#/$defs/{ref}", "$defs": k8s_schemas["$defs"]}
        errors = _errors(jsonschema.Draft202012Validator(schema), obj)
        assert errors == [], (obj["kind"], errors)
    bad = copy.deepcopy(next(o for o in core if o["kind"] == "StatefulSet"))
    bad["spec"]["replica"] = 1
    ref = k8s_schemas["kinds"]["apps/v1/StatefulSet"]
    schema = {"$ref": f"#/$defs/{ref}", "$defs": k8s_schemas["$defs"]}
    assert _errors(jsonschema.Draft202012Validator(schema), bad)


# --- what the manifests must say ----------------------------------------------------------


def test_rayservice_upgrade_strategy_and_no_dead_fields(rayservice) -> None:
    spec = rayservice["spec"]
    assert not DEAD_FIELDS & set(spec)
    assert spec["upgradeStrategy"]["type"] in UPGRADE_TYPES


def test_images_come_from_kustomize(rendered, rayservice) -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    (image,) = kust["images"]
    want = f"{image['newName']}:{image['newTag']}"
    cluster = rayservice["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    seen = [
        c["image"]
        for g in pods
        for c in g["template"]["spec"].get("containers", [])
        + g["template"]["spec"].get("initContainers", [])
    ]
    assert len(seen) == 3 and set(seen) == {want}
    raw = (K8S / "rayservice.yaml").read_text()
    assert want not in raw  # the tag lives in one place


def test_storage_binds_with_a_default_provisioner(rendered, rayservice) -> None:
    """Every claim is ReadWriteOnce with no storageClassName (the default class binds it); the
    model reaches the GPU pods by an init container pulling it from S3 into an emptyDir."""
    claims = [
        t["spec"]
        for o in rendered
        if o["kind"] == "StatefulSet"
        for t in o["spec"].get("volumeClaimTemplates", [])
    ] + [o["spec"] for o in rendered if o["kind"] == "PersistentVolumeClaim"]
    assert claims
    for spec in claims:
        assert spec["accessModes"] == ["ReadWriteOnce"] and "storageClassName" not in spec
    (gpu,) = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    pod = gpu["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes["models"] and "persistentVolumeClaim" not in volumes["models"]
    (init,) = pod["initContainers"]
    assert {"name": "models", "mountPath": "/models"} in init["volumeMounts"]
    compile(init["args"][0], "fetch-model", "exec")  # the pull script is valid Python
    model = next(e["value"] for e in init["env"] if e["name"] == "MODEL")
    serve = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    assert serve["applications"][0]["args"]["engine"]["model"] == f"/models/{model}"


def test_rayservice_cluster_shape(rendered, rayservice) -> None:
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["rayVersion"] == importlib.import_module("ray").__version__
    (gpu,) = cluster["workerGroupSpecs"]
    limits = gpu["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 1 and gpu["maxReplicas"] > gpu["minReplicas"]
    secrets = {o["metadata"]["name"]: o for o in rendered if o["kind"] == "Secret"}
    for group in [cluster["headGroupSpec"], gpu]:
        spec = group["template"]["spec"]
        for container in spec["containers"] + spec.get("initContainers", []):
            assert {e["secretRef"]["name"] for e in container["envFrom"]} <= set(secrets)
    for name, env in [("mpic-s3-credentials", "s3-credentials"), ("mpic-api-keys", "api-keys")]:
        example = _env_file(K8S / "secrets" / f"{env}.env.example")
        data = {k: base64.b64decode(v).decode() for k, v in secrets[name]["data"].items()}
        assert data == example


def test_dockerfile_builds_cpu_and_gpu_images() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "ARG DEVICE=gpu" in text and "FROM base-${DEVICE}" in text
    ray = importlib.import_module("ray").__version__
    assert f"ARG RAY_VERSION={ray}" in text
    for device in ("cpu", "gpu"):
        assert f"rayproject/ray:${{RAY_VERSION}}-py311-{device} AS base-{device}" in text
    assert '".[cpu]"' in text and '".[gpu]"' in text and "torch==2.13.0+cpu" in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".mpic", ".git", "k8s/secrets/*.env"} <= set(ignored)


# --- serve config resolves to the code ------------------------------------------------------


def _serve_configs() -> list[tuple[str, dict]]:
    out = [
        (
            "deployments/serve_config.yaml",
            yaml.safe_load((ROOT / "deployments" / "serve_config.yaml").read_text()),
        )
    ]
    for doc in yaml.safe_load_all((K8S / "rayservice.yaml").read_text()):
        if doc and doc.get("kind") == "RayService":
            out.append(("k8s/rayservice.yaml", yaml.safe_load(doc["spec"]["serveConfigV2"])))
    return out


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


def test_embedded_default_serves_with_vllm_and_routes_by_cache() -> None:
    """`mpic serve` / `./run demo` without a config: the vLLM worker, cache-aware routing; the
    shipped local YAML keeps the reference runner as a config choice."""
    from mpic.deployments.config import load_config

    default = load_config(None)
    assert default.engine.kind == "vllm" and default.llm_router == "cache-aware"
    assert load_config(ROOT / "deployments" / "serve_config.yaml").engine.kind == "reference"


def test_readiness_probes_ask_whether_every_deployment_can_serve(rayservice) -> None:
    """Head and GPU workers are ready only when `/readyz` answers (every Serve deployment has a
    running replica: engines loaded), on the Serve port the proxies listen on."""
    serve = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    port = serve["http_options"]["port"]
    cluster = rayservice["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        (container,) = group["template"]["spec"]["containers"]
        probe = container["readinessProbe"]["httpGet"]
        assert probe == {"path": "/readyz", "port": port}


def test_proxies_gate_the_start_up_as_mpic_serve_does(rayservice) -> None:
    """Every node runs a Serve proxy (`proxy_location: EveryNode`): the head and the GPU workers
    set the proxy-callback variable `mpic serve` sets (`start_local`), so every route answers
    JSON 503 `not_ready` until the proxy can route to a running Ingress (`startup_gate`), and
    the import path it names resolves to the gate's hook."""
    from mpic.deployments.http.startup_gate import PROXY_CALLBACK, PROXY_CALLBACK_ENV

    serve = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    assert serve["proxy_location"] == "EveryNode"
    cluster = rayservice["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        (container,) = group["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert env.get(PROXY_CALLBACK_ENV) == PROXY_CALLBACK, container["name"]
    module, _, attr = PROXY_CALLBACK.partition(":")
    assert callable(getattr(importlib.import_module(module), attr))
