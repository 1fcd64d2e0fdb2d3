"""Re-creates the vendored schemas of this folder (run by hand, never by the tests; needs the
network or local copies of the two sources). The tests validate k8s/ against these files offline.

- `rayservice-v1-kuberay-v1.7.0.json`: the `v1` version's `openAPIV3Schema` of KubeRay's
  RayService CRD, verbatim (source: github.com/ray-project/kuberay, tag v1.7.0,
  helm-chart/kuberay-operator/crds/ray.io_rayservices.yaml).
- `k8s-v1.33.0-strict.json`: the Kubernetes 1.33 "strict" JSON schemas (additionalProperties:
  false) of the core kinds k8s/ uses, as shipped by PyPI's `kubernetes-validate` 1.37.0
  (kubernetes_validate/kubernetes-json-schema/v1.33.0-local-strict/): one document whose
  `$defs` hold the closure of `$ref`s of those kinds, and `kinds` maps "apiVersion/kind" to
  the top-level definition.

    python tests/deployments/schemas/vendor.py CRD_YAML SCHEMA_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).parent
KINDS = {
    "v1/Secret": "io.k8s.api.core.v1.Secret",
    "v1/Service": "io.k8s.api.core.v1.Service",
    "v1/PersistentVolumeClaim": "io.k8s.api.core.v1.PersistentVolumeClaim",
    "apps/v1/StatefulSet": "io.k8s.api.apps.v1.StatefulSet",
}


def local_refs(node: object, found: set[str]) -> object:
    """`node` with every `$ref` ".../_definitions.json#/$defs/NAME" made "#/$defs/NAME";
    the names go into `found`."""
    if isinstance(node, dict):
        out = {k: local_refs(v, found) for k, v in node.items()}
        if "$ref" in out:
            name = out["$ref"].rsplit("/", 1)[1]
            found.add(name)
            out["$ref"] = f"#/$defs/{name}"
        return out
    if isinstance(node, list):
        return [local_refs(v, found) for v in node]
    return node


def main(crd_yaml: str, schema_dir: str) -> None:
    crd = yaml.safe_load(Path(crd_yaml).read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    out = HERE / "rayservice-v1-kuberay-v1.7.0.json"
    out.write_text(json.dumps(v1["schema"]["openAPIV3Schema"], separators=(",", ":")))
    defs = json.loads((Path(schema_dir) / "_definitions.json").read_text())["$defs"]
    keep: dict[str, object] = {}
    todo = list(KINDS.values())
    while todo:
        name = todo.pop()
        if name not in keep:
            found: set[str] = set()
            keep[name] = local_refs(defs[name], found)
            todo.extend(found)
    doc = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "kinds": KINDS,
        "$defs": dict(sorted(keep.items())),
    }
    (HERE / "k8s-v1.33.0-strict.json").write_text(json.dumps(doc, separators=(",", ":")))


if __name__ == "__main__":
    main(*sys.argv[1:3])
