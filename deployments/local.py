"""Starting the application on a local Ray instance (CLI process: `mpic serve`, `mpic demo`,
tests and the load benchmark).

`prepare_local(cfg)` makes relative paths absolute (Ray replicas may start in another working
directory) and writes the embedded default's small random model (the one `mpic demo` uses) if it
is missing; `start_local(cfg, port)`
starts Ray, Serve's HTTP proxy on loopback and the application, and waits until `/healthz`
answers. One Ray instance per process: `stop_local()` tears it down.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import httpx

from mpic.config import MPICHome
from mpic.deployments.config import ServeAppConfig

logger = logging.getLogger(__name__)

_ENV_PASSED = (
    "MPIC_API_KEYS",
    "MPIC_ADMIN_KEYS",
    "MPIC_S3_ACCESS_KEY",
    "MPIC_S3_SECRET_KEY",
    "MPIC_HOME",
    "OMP_NUM_THREADS",
)


def prepare_local(cfg: ServeAppConfig, make_model: bool = True) -> ServeAppConfig:
    """A copy of `cfg` with absolute model and store paths; writes the small default model."""
    model = Path(cfg.engine.model).expanduser().resolve()
    builtin = cfg.engine.kind in ("reference", "vllm")  # the fake or a custom engine: no model
    if make_model and builtin and not (model / "config.json").is_file():
        from mpic.engine.tiny.models import make_tiny

        logger.warning("writing the small random %s model to %s", cfg.engine.family, model)
        make_tiny(cfg.engine.family, "small", model)
    store = cfg.store
    if store.url is None and store.s3 is None:
        store = store.model_copy(update={"url": MPICHome().store_dir.resolve().as_uri()})
    engine = cfg.engine.model_copy(update={"model": str(model)})
    return cfg.model_copy(update={"engine": engine, "store": store})


METRICS_REPORT_INTERVAL_MS = 2000
"""How often a local Ray cluster's processes report metrics to the node's agent (Ray's default
is 10 s; 2 s makes `/metrics` reflect a request within a few seconds)."""


def start_local(
    cfg: ServeAppConfig,
    port: int = 8000,
    num_cpus: int | None = None,
    timeout_s: float = 300,
    log_to_driver: bool = True,
    host: str = "127.0.0.1",
    address: str | None = None,
    overrides: dict | None = None,
) -> str:
    """Start Ray + Serve's HTTP proxy on `host`:`port` with the application; returns the base
    URL. `address`: join that running Ray cluster ("auto", "ray://host:10001", "host:6379")
    instead of starting one; `overrides`: a Serve config's `deployments:` section
    (`build_app`). `log_to_driver=False` keeps replica logs in Ray's log folder (tests,
    benchmarks)."""
    import ray
    from ray import serve

    from mpic.deployments.app import build_app

    cfg = prepare_local(cfg)
    env = {k: os.environ[k] for k in _ENV_PASSED if k in os.environ}
    if not ray.is_initialized():
        if address:
            ray.init(
                address=address,
                runtime_env={"env_vars": env},
                logging_level=logging.WARNING,
                log_to_driver=log_to_driver,
            )
        else:
            ray.init(
                num_cpus=num_cpus or os.cpu_count(),
                include_dashboard=False,
                runtime_env={"env_vars": env},
                logging_level=logging.WARNING,
                log_to_driver=log_to_driver,
                _system_config={"metrics_report_interval_ms": METRICS_REPORT_INTERVAL_MS},
            )
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(cfg, overrides), name=cfg.name, route_prefix=cfg.route_prefix)
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    wait_healthy(url, timeout_s)
    return url


def wait_healthy(url: str, timeout_s: float = 300) -> None:
    """Poll `GET /healthz`, then `GET /readyz`, until both answer 200: the proxy routes and every
    deployment can serve (TimeoutError otherwise)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if all(
                httpx.get(f"{url}{path}", timeout=2).status_code == 200
                for path in ("/healthz", "/readyz")
            ):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}/healthz did not answer within {timeout_s} s")


def is_serving(url: str) -> bool:
    """True if an MPIC server answers at `url`."""
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def stop_local(app_name: str | None = None) -> None:
    """Shut Serve and Ray down (idempotent). `app_name`: only delete that application and
    disconnect (a cluster this process joined, not started, keeps running)."""
    import ray
    from ray import serve

    if ray.is_initialized():
        if app_name is None:
            serve.shutdown()
        else:
            serve.delete(app_name)
        ray.shutdown()
