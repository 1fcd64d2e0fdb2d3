"""Two Ray nodes on this machine sharing cache entries through S3 only (slow; its own process).

`ray.cluster_utils.Cluster` starts a head raylet offering the custom resource `node_a` and a
second raylet offering `node_b` (separate GCS-registered nodes with their own object stores and
worker pools). Two copies of the MPIC application run on them, pinned by those resources: `a`
(route /a, every deployment on node_a) and `b` (route /b, every deployment on node_b). Both use
the same moto S3 bucket as the durable store and each its OWN disk-tier folder, so nothing but
S3 connects them. A file uploaded through node A (its LLM worker computes the entry and writes it
through to S3) is then asked about through node B: node B's LLM worker has never seen it and must
read the entry from S3 (`tier_hits == {"object": n}` in the answer's `mpic` field: the serving
worker's count of the tier each entry came from), and the answer equals node A's single-node one
(entries from its memory tier). Node B's own disk folder then holds the entries (the S3 read
fills it), and a second ask on node B hits its memory tier. Every replica's node is read from
Ray's actor table.

The engine is the HF reference runner on the tiny LLaVA: two vLLM engines (one per node) do not
fit on the 2 CPU cores of CI.

The test runs this module as a script (`python -m tests.deployments.app.test_multinode MODEL OUT`)
so that its Ray cluster never meets the session's single-node Ray instance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
KEYS = {"alice-key": "alice"}


@pytest.mark.slow
def test_entry_uploaded_on_node_a_is_read_from_s3_on_node_b(
    tiny_llava_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "multinode.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.deployments.app.test_multinode",
            str(tiny_llava_dir),
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    facts = json.loads(out.read_text())
    print(json.dumps(facts, indent=1))

    nodes = facts["nodes"]
    assert len(nodes) == 2 and {n["resource"] for n in nodes.values()} == {"node_a", "node_b"}
    placement = facts["placement"]  # "app:Deployment" -> node resource of every replica
    for app, node in (("a", "node_a"), ("b", "node_b")):
        for dep in ("Ingress", "Encoder", "Resolver", "Retriever", "LLMWorker"):
            assert placement[f"{app}:{dep}"] == [node], (app, dep, placement)
    assert facts["disk_dirs"]["a"] != facts["disk_dirs"]["b"]

    n = facts["images"]
    upload_a, ask_a, ask_b, again_b = (facts[k] for k in ("upload_a", "ask_a", "ask_b", "again_b"))
    assert ask_a["tier_hits"] == {"memory": n}  # node A computed the entries on upload
    assert ask_b["tier_hits"] == {"object": n}  # node B had them only in S3
    assert again_b["tier_hits"] == {"memory": n}  # ... and keeps them in its memory tier now
    assert ask_b["answer"] == ask_a["answer"] and ask_b["answer"]
    assert ask_b["cached_tokens"] == ask_a["cached_tokens"] > 0
    assert facts["b_disk_files"] == n  # node B's own disk tier, filled by the S3 read
    assert facts["a_disk_files"] == n and upload_a["ids"]


def _run(model_dir: str, out: str) -> None:
    """The script body: cluster, S3, two pinned apps, upload on A, asks on A and B."""
    import httpx
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster
    from ray.util.state import list_actors

    from mpic.deployments.app import build_app
    from mpic.deployments.config import ServeAppConfig
    from mpic.deployments.local import prepare_local, wait_healthy
    from tests.deployments.conftest import png
    from tests.fixtures.s3 import S3Server, free_port

    s3 = S3Server()
    s3.start()
    s3cfg = s3.config(bucket="mpic-multinode")
    work = Path(tempfile.mkdtemp(prefix="mpic-multinode-"))
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"node_a": 100}},
    )
    cluster.add_node(num_cpus=2, resources={"node_b": 100})
    cluster.wait_for_nodes()
    env = {"MPIC_API_KEYS": json.dumps(KEYS), "MPIC_ADMIN_KEYS": "[]", "OMP_NUM_THREADS": "1"}
    ray.init(address=cluster.address, runtime_env={"env_vars": env}, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    facts: dict = {"disk_dirs": {}}
    try:
        for app in ("a", "b"):
            pin = {"num_cpus": 0.1, "resources": {f"node_{app}": 1}}
            disk = work / f"disk-node_{app}"
            facts["disk_dirs"][app] = str(disk)
            cfg = ServeAppConfig.model_validate(
                {
                    "name": app,
                    "route_prefix": f"/{app}",
                    "engine": {"kind": "reference", "model": model_dir, "max_tokens_default": 6},
                    "store": {
                        "s3": s3cfg.model_dump(mode="python")
                        | {"secret_key": s3cfg.secret_key.get_secret_value()},
                        "disk_cache_dir": str(disk),
                        "memory_bytes": 64 << 20,
                    },
                    "auth": {"mode": "production"},
                    **{d: pin for d in ("ingress", "encoder", "retriever", "resolver")},
                    "llm_worker": pin,
                }
            )
            serve.run(build_app(prepare_local(cfg)), name=app, route_prefix=f"/{app}")
            wait_healthy(f"http://127.0.0.1:{port}/{app}", 300)

        nodes = {
            n["NodeID"]: next(r for r in n["Resources"] if r.startswith("node_"))
            for n in ray.nodes()
            if n["Alive"]
        }
        facts["nodes"] = {nid: {"resource": res} for nid, res in nodes.items()}
        placement: dict[str, list[str]] = {}
        for actor in list_actors(filters=[("state", "=", "ALIVE")], limit=1000):
            name = actor.class_name  # ServeReplica:<app>:<Deployment>
            if name.startswith("ServeReplica:"):
                _, app, dep = name.split(":")
                placement.setdefault(f"{app}:{dep}", []).append(nodes[actor.node_id])
        facts["placement"] = {k: sorted(v) for k, v in placement.items()}

        base = f"http://127.0.0.1:{port}"
        auth = {"Authorization": "Bearer alice-key"}
        with httpx.Client(base_url=base, headers=auth, timeout=300) as http:
            ids = []
            for i in range(2):
                resp = http.post(
                    "/a/v1/files",
                    files={"file": (f"img-{i}.png", png(100 + i), "image/png")},
                    data={"purpose": "vision"},
                )
                resp.raise_for_status()
                ids.append(resp.json()["id"])
            facts["images"] = len(ids)
            facts["upload_a"] = {"ids": ids}
            content = [
                {"type": "text", "text": "Compare"},
                {"type": "file", "file": {"file_id": ids[0]}},
                {"type": "text", "text": "with"},
                {"type": "file", "file": {"file_id": ids[1]}},
                {"type": "text", "text": "please."},
            ]

            def ask(app: str) -> dict:
                body = {
                    "model": "mpic",
                    "max_tokens": 6,
                    "mpic": {"policy": "mpic-4"},
                    "messages": [{"role": "user", "content": content}],
                }
                r = http.post(f"/{app}/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                j = r.json()
                return {
                    "answer": j["choices"][0]["message"]["content"],
                    "tier_hits": j["mpic"]["tier_hits"],
                    "cached_tokens": j["usage"]["prompt_tokens_details"]["cached_tokens"],
                }

            facts["ask_a"], facts["ask_b"], facts["again_b"] = ask("a"), ask("b"), ask("b")
        for app in ("a", "b"):
            files = [p for p in Path(facts["disk_dirs"][app]).rglob("*") if p.is_file()]
            facts[f"{app}_disk_files"] = len(files)
    finally:
        Path(out).write_text(json.dumps(facts, indent=1))
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        s3.stop()


if __name__ == "__main__":
    _run(sys.argv[1], sys.argv[2])
