"""The live fidelity monitor's series on `/metrics` as an operator sees them: `mpic serve` in a
subprocess (a real Ray cluster; reference engine on the tiny LLaVA; every request sampled). After
two linked chats, the ingress's `/metrics` carries the KL and top-1 histograms of the `mpic`
policy family (recorded by the LLM-worker replica, exported by Ray's metrics agent) and the
shadow counter, each sample once; then, while six clients keep the worker busy, every shadow is
shed (counted) and none runs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.deployments.conftest import free_port, png, serve_config_file

pytestmark = pytest.mark.slow


def _config(tmp_path: Path, model: Path) -> Path:
    args = {
        "engine": {"kind": "reference", "model": str(model), "max_tokens_default": 3},
        "store": {"url": (tmp_path / "store").as_uri(), "fsync": False},
        "auth": {"mode": "dev"},
        "sweep_interval_s": 0,
        "fidelity": {"sample_rate": 1.0},
    }
    return serve_config_file(tmp_path, args)


def _value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}\{{(.*)\}} ([0-9.e+-]+)$", line)
        if m and all(f'{k}="{v}"' in m[1] for k, v in labels.items()):
            total += float(m[2])
    return total


def test_fidelity_histograms_on_metrics(tmp_path: Path, tiny_llava_dir: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("MPIC_API_KEYS", "MPIC_ADMIN_KEYS")}
    env |= {"OMP_NUM_THREADS": "1", "MPIC_HOME": str(tmp_path / "home")}
    mpic = Path(sys.executable).parent / "mpic"
    cmd = [str(mpic), "serve", "--config", str(_config(tmp_path, tiny_llava_dir))]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    h = {"Authorization": "Bearer mpic-dev-alice"}
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        up = httpx.post(
            f"{url}/v1/files",
            files={"file": ("x.png", png(5), "image/png")},
            data={"purpose": "vision"},
            headers=h,
            timeout=60,
        )
        assert up.status_code == 200, up.text
        part = {"type": "file", "file": {"file_id": up.json()["id"]}}
        body = {
            "model": "mpic",
            "mpic": {"policy": "mpic-4"},
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": "what?"}]}],
        }
        for i in range(2):
            r = httpx.post(
                f"{url}/v1/chat/completions",
                json=body,
                headers={**h, "X-Request-ID": f"fid-{i}"},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            time.sleep(1)  # the shadow runs after the answer, while nothing else is in flight
        deadline, text = time.monotonic() + 90, ""
        while time.monotonic() < deadline:
            text = httpx.get(f"{url}/metrics", timeout=10).text
            if _value(text, "ray_mpic_fidelity_kl_count", policy="mpic") >= 2:
                break
            time.sleep(2)
        print("\n".join(line for line in text.splitlines() if "fidelity" in line))
        assert _value(text, "ray_mpic_fidelity_kl_count", policy="mpic") == 2
        assert _value(text, "ray_mpic_fidelity_kl_bucket", policy="mpic", le="+Inf") == 2
        assert _value(text, "ray_mpic_fidelity_top1_agreement_count", policy="mpic") == 2
        assert _value(text, "ray_mpic_fidelity_shadows_total", outcome="run") == 2
        assert _value(text, "ray_mpic_fidelity_topk_kl_count") == 0  # vLLM's kind only
        # overload: 6 clients back to back; while they run, every shadow is shed, none runs
        stop, answered = threading.Event(), []

        def client(i: int) -> None:
            n = 0
            while not stop.is_set():
                r = httpx.post(
                    f"{url}/v1/chat/completions",
                    json=body,
                    headers={**h, "X-Request-ID": f"load-{i}-{n}"},
                    timeout=120,
                )
                answered.append(r.status_code)
                n += 1

        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        try:
            deadline, shed = time.monotonic() + 90, 0.0
            while time.monotonic() < deadline and shed < 10:
                time.sleep(2)
                text = httpx.get(f"{url}/metrics", timeout=10).text
                shed = _value(text, "ray_mpic_fidelity_shadows_total", outcome="shed_load")
            run = _value(text, "ray_mpic_fidelity_shadows_total", outcome="run")
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=120)
        print(f"overload: {len(answered)} answers {set(answered)}, shed {shed}, run {run}")
        assert shed >= 10 and run == 2  # only the two shadows from before the overload
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
