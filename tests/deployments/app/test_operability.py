"""`mpic serve` as an operator runs it (a real Ray cluster in a subprocess, fake engine, two
ingress replicas set in Serve's `deployments:` section): `/metrics` counts the requests served by
BOTH ingress replicas (Ray Serve's metrics API, aggregated by Ray's metrics agent), the request
id reaches the response, and SIGTERM shuts everything down with no process left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import httpx
import psutil
import pytest

from tests.deployments.conftest import free_port, png, serve_config_file

pytestmark = pytest.mark.slow

N_REQUESTS = 24


def _config(tmp_path: Path) -> Path:
    args = {
        "engine": {"kind": "fake", "model": "fake"},
        "store": {"url": (tmp_path / "store").as_uri(), "fsync": False},
        "auth": {"mode": "dev"},
        "sweep_interval_s": 0,
        "llm_router": "power-of-two",
    }
    return serve_config_file(tmp_path, args, replicas={"Ingress": 2})


def _series(text: str, name: str) -> dict[tuple, float]:
    """{(label=value, ...): value} of one metric's samples."""
    out: dict[tuple, float] = {}
    for line in text.splitlines():
        m = re.match(rf"^{name}\{{(.*)\}} ([0-9.e+-]+)$", line)
        if m:
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m[1])))
            out[labels] = float(m[2])
    return out


def test_two_ingress_replicas_metrics_and_sigterm(tmp_path: Path) -> None:
    port = free_port()
    # The subprocess runs with the dev keys: drop keys another test's fixture may have configured.
    env = {k: v for k, v in os.environ.items() if k not in ("MPIC_API_KEYS", "MPIC_ADMIN_KEYS")}
    env |= {"OMP_NUM_THREADS": "1", "MPIC_HOME": str(tmp_path / "home")}
    mpic = Path(sys.executable).parent / "mpic"
    proc = subprocess.Popen(
        [str(mpic), "serve", "--config", str(_config(tmp_path)), "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if all(  # the proxy routes and every deployment can serve
                    httpx.get(f"{url}{path}", timeout=2).status_code == 200
                    for path in ("/healthz", "/readyz")
                ):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert tree, "Ray's processes run under mpic serve"
        h = {"Authorization": "Bearer mpic-dev-alice"}
        body = {"model": "mpic", "messages": [{"role": "user", "content": "red cat"}]}
        # Each ingress replica follows readiness itself: the one that answered /readyz can be one
        # poll ahead of the other, whose 503 not_ready says Retry-After (as OpenAI's client
        # retries a 503) for the first seconds after start.
        deadline = time.monotonic() + 60
        for i in range(N_REQUESTS):
            while True:
                r = httpx.post(
                    f"{url}/v1/chat/completions",
                    json=body,
                    headers={**h, "X-Request-ID": f"req-{i}"},
                    timeout=30,
                )
                if r.status_code != 503 or time.monotonic() > deadline:
                    break
                assert r.json()["error"]["code"] == "not_ready" and r.headers["retry-after"]
                time.sleep(1)
            assert r.status_code == 200 and r.headers["x-request-id"] == f"req-{i}", r.text
            assert r.json()["mpic"]["request_id"] == f"req-{i}"
        files = {"file": ("x.png", png(1), "image/png")}
        up = httpx.post(f"{url}/v1/files", files=files, data={"purpose": "vision"}, headers=h)
        assert up.status_code == 200, up.text
        part = {"type": "file", "file": {"file_id": up.json()["id"]}}
        linked = {"model": "mpic", "messages": [{"role": "user", "content": [part]}]}
        r = httpx.post(f"{url}/v1/chat/completions", json=linked, headers=h, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        bad = httpx.post(f"{url}/v1/chat/completions", json={"model": "x"}, headers=h)
        assert bad.status_code == 400
        deadline, per_replica = time.monotonic() + 60, {}
        while time.monotonic() < deadline:
            text = httpx.get(f"{url}/metrics", timeout=10).text
            per_replica = defaultdict(float)
            for labels, value in _series(text, "ray_mpic_requests_total").items():
                d = dict(labels)
                if d.get("route") == "/v1/chat/completions" and d.get("outcome") == "ok":
                    per_replica[d["replica"]] += value
            # every series below comes from a replica's own metrics export, each on its own
            # schedule: wait for all of them, not only the ingress's request counts
            memory_hits = sum(
                v
                for k, v in _series(text, "ray_mpic_store_hits_total").items()
                if dict(k).get("tier") == "memory"
            )
            cached = sum(_series(text, "ray_mpic_cached_tokens_total").values())
            if sum(per_replica.values()) >= N_REQUESTS + 1 and memory_hits >= 1 and cached > 0:
                break
            time.sleep(2)
        print("requests per ingress replica:", dict(per_replica))
        assert sum(per_replica.values()) == N_REQUESTS + 1  # + the linked chat
        assert len(per_replica) == 2 and all(v > 0 for v in per_replica.values())
        for series in ("ttft_seconds_bucket", "inter_token_seconds_bucket", "uploads_total"):
            assert f"ray_mpic_{series}" in text, series
        hits = _series(text, "ray_mpic_store_hits_total")
        assert sum(v for k, v in hits.items() if dict(k).get("tier") == "memory") >= 1
        assert sum(_series(text, "ray_mpic_cached_tokens_total").values()) > 0
        errors = _series(text, "ray_mpic_requests_total")
        assert any(dict(k).get("outcome") == "400" for k in errors)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, out
    assert "stopped" in out
    time.sleep(2)
    alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [p.name() for p in alive]
