"""One real local Ray Serve instance for the whole session (tests/deployments): the MPIC
application on the tiny LLaVA, a filesystem store in a temp folder, production-mode keys for two
users and an admin, small limits (so 413 is cheap to hit) and an LLM worker that autoscales 1 -> 2
at `target_ongoing_requests=1` (the autoscaling test)."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

KEYS = {"alice-key": "alice", "bob-key": "bob"}
ADMIN_KEY = "root-key"
MAX_UPLOAD = 256 * 1024


@dataclass
class ServeApp:
    """A running application: base URL and the config it was started with."""

    url: str
    config: object

    def headers(self, key: str) -> dict[str, str]:
        """Authorization header for `key`."""
        return {"Authorization": f"Bearer {key}"}


def free_port() -> int:
    """A loopback TCP port free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DEPLOYMENTS = ("Ingress", "Encoder", "Retriever", "Resolver", "LLMWorker")


def serve_config_file(tmp_path: Path, args: dict, replicas: dict[str, int] | None = None) -> Path:
    """A Serve config YAML for `mpic serve --config` in `tmp_path`: the app built from `args`
    (the `ServeAppConfig` fields), every deployment small (0.05 CPU, one replica unless
    `replicas` says)."""
    import yaml

    small = {"ray_actor_options": {"num_cpus": 0.05}}
    deployments = [
        {"name": n, **small, "num_replicas": (replicas or {}).get(n, 1)} for n in DEPLOYMENTS
    ]
    app = {
        "name": "mpic",
        "import_path": "mpic.deployments.app:app_builder",
        "args": args,
        "deployments": deployments,
    }
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"applications": [app]}))
    return path


def serve_config(model_dir: Path, store_dir: Path):
    """The test application's ServeAppConfig."""
    from mpic.deployments.config import ServeAppConfig

    small = {"num_cpus": 0.1, "autoscaling": {"min_replicas": 1, "max_replicas": 1}}
    return ServeAppConfig.model_validate(
        {
            "engine": {"kind": "reference", "model": str(model_dir), "max_tokens_default": 6},
            "store": {"url": store_dir.as_uri(), "fsync": False, "memory_bytes": 64 << 20},
            "auth": {"mode": "production"},
            "limits": {"max_upload_bytes": MAX_UPLOAD},
            "ingress": small,
            "encoder": small,
            "retriever": small,
            "resolver": small,
            "llm_worker": {
                "num_cpus": 0.1,
                "max_ongoing_requests": 8,
                "autoscaling": {
                    "min_replicas": 1,
                    "max_replicas": 2,
                    "target_ongoing_requests": 1,
                    "upscale_delay_s": 0.5,
                    "downscale_delay_s": 600,
                    "metrics_interval_s": 0.5,
                    "look_back_period_s": 2,
                },
            },
        }
    )


FIRST_ON_THE_SHARED_APP = ("tests/deployments/app/test_load_autoscale.py",)
"""Tests that need the shared app (`serve_app`) at one LLM-worker replica: another test's load
may scale it to two, which stay for the 600 s downscale delay, so these run first in this
package (ahead of the other tests in the rooms that use `serve_app`, wherever they sort)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Move `FIRST_ON_THE_SHARED_APP` to the front of this package's tests."""
    here = [i for i, item in enumerate(items) if item.nodeid.startswith("tests/deployments/")]
    first = [items[i] for i in here if item_file(items[i]) in FIRST_ON_THE_SHARED_APP]
    if not here or not first:
        return
    rest = [item for item in items if item not in first]
    start = rest.index(items[here[0]]) if items[here[0]] not in first else here[0]
    items[:] = rest[:start] + first + rest[start:]


def item_file(item: pytest.Item) -> str:
    """The test file of `item`, as its node id names it."""
    return item.nodeid.split("::", 1)[0]


@pytest.fixture(scope="package")
def serve_app(tiny_llava_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeApp]:
    """Start Ray (2 CPUs) + Serve + the application once; shut everything down after the last
    test of tests/deployments (package scope: the idle app does not run beside the rest of the
    suite)."""
    from mpic.deployments.local import start_local, stop_local

    saved = {k: os.environ.get(k) for k in ("MPIC_API_KEYS", "MPIC_ADMIN_KEYS", "OMP_NUM_THREADS")}
    os.environ.update(
        {
            "MPIC_API_KEYS": json.dumps(KEYS),
            "MPIC_ADMIN_KEYS": json.dumps([ADMIN_KEY]),
            "OMP_NUM_THREADS": "1",
        }
    )
    cfg = serve_config(tiny_llava_dir, tmp_path_factory.mktemp("serve-store"))
    # admin refreshes may read the session's temp folders only
    cfg = cfg.model_copy(update={"admin_sources": [str(tmp_path_factory.getbasetemp())]})
    try:
        url = start_local(cfg, port=free_port(), num_cpus=2, log_to_driver=False)
        yield ServeApp(url=url, config=cfg)
    finally:
        stop_local()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def png(seed: int, side: int = 40) -> bytes:
    """A seeded random RGB PNG."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def upload(app: ServeApp, key: str, data: bytes, name: str = "x.png", **form: str):
    """POST /v1/files; returns the httpx response."""
    import httpx

    return httpx.post(
        f"{app.url}/v1/files",
        headers=app.headers(key),
        timeout=120,
        files={"file": (name, data, "image/png")},
        data={"purpose": "vision", **form},
    )


def chat(app: ServeApp, key: str, content: list, policy: str = "mpic-4", **body):
    """POST /v1/chat/completions (non-streaming); returns the httpx response."""
    import httpx

    payload = {
        "model": "mpic",
        "max_tokens": 6,
        "mpic": {"policy": policy},
        "messages": [{"role": "user", "content": content}],
        **body,
    }
    return httpx.post(
        f"{app.url}/v1/chat/completions", headers=app.headers(key), json=payload, timeout=120
    )


@pytest.fixture
def fake_app(tmp_path: Path):
    """The application in-process on the fake engine (no Ray, no model): HTTP tests in ms.
    Same keys as `serve_app`; a fresh store per test."""
    from tests.deployments.inprocess import fake_config, in_process_app

    with in_process_app(fake_config(tmp_path / "store"), KEYS, [ADMIN_KEY]) as app:
        yield app
