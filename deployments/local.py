"""Starting the application on a local Ray instance (CLI process: `mpic serve`, `mpic demo`,
tests and the load benchmark).

`prepare_local(cfg)` makes relative paths absolute (Ray replicas may start in another working
directory) and writes the embedded default's small random model (the one `mpic demo` uses) if it
is missing; `start_local(cfg, port)` ends what a crashed local run left, starts Ray (its ports on
the API's interface where Ray allows it: all of them on the loopback for a loopback API; no
dashboard), Serve's HTTP proxy and the application, and waits until `/healthz` and `/readyz`
answer. One Ray instance per process: `stop_local()` tears it down and ends any of its processes
that outlived the shutdown (`mpic.deployments.local_runs`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from mpic.config import MPICHome
from mpic.deployments.config import ServeAppConfig
from mpic.deployments.deployment_config import DEPLOYMENT_NAMES
from mpic.deployments.local_runs import (
    end_orphans,
    end_run,
    loopback_node,
    ray_node_ip,
    record_run,
)

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

LOCAL_DRAIN_WAIT_S = 0.2
"""`graceful_shutdown_wait_loop_s` of every deployment on a Ray instance started here (Serve's
default: 2 s). A stopping replica first waits this long, for routers to learn it goes, then until
its requests are done; Serve stops the deployments in 4 tiers here (Ingress, then Encoder and
Resolver, Retriever, LLMWorker), so Serve's default made a stop take ~9 s of waits. On one node
the routers learn it within milliseconds, and a request that still reaches a stopping replica is
refused and retried elsewhere by Serve."""

_OWN_RUN: list[Path] = []
"""The record of the Ray instance this process started (`local_runs`), while it runs."""


@contextmanager
def _callers_sigterm() -> Iterator[None]:
    """`ray.init` installs its own SIGTERM handlers in this process (Python's exits; its core
    worker's prints a stack trace and aborts, status -6): a Python handler the caller installed
    (`mpic serve`'s clean stop) is put back as soon as Ray is up."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if callable(previous):
            signal.signal(signal.SIGTERM, previous)


def local_overrides(overrides: dict | None) -> dict:
    """`overrides` (a Serve config's `deployments:` section) with `LOCAL_DRAIN_WAIT_S` for every
    deployment that does not set its own."""
    out = {name: dict(opts) for name, opts in (overrides or {}).items()}
    for name in DEPLOYMENT_NAMES:
        out.setdefault(name, {}).setdefault("graceful_shutdown_wait_loop_s", LOCAL_DRAIN_WAIT_S)
    return out


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
    benchmarks).

    A Ray instance started here first ends what a crashed local run left (`end_orphans`), binds
    its ports to `host`'s address where Ray allows it (`ray_node_ip`), starts no dashboard (Ray
    still starts its dashboard head process, loading only the usage-stats module, which
    `ray.init` turns off), and is recorded under `MPIC_HOME/run` so that `stop_local` and the
    next start find its processes."""
    home = MPICHome().home
    end_orphans(home)
    import ray
    from ray import serve

    from mpic.deployments.app import build_app
    from mpic.deployments.http.startup_gate import PROXY_CALLBACK, PROXY_CALLBACK_ENV

    cfg = prepare_local(cfg)
    env = {k: os.environ[k] for k in _ENV_PASSED if k in os.environ}
    if not ray.is_initialized():
        if address:
            with _callers_sigterm():
                ray.init(
                    address=address,
                    runtime_env={"env_vars": env},
                    logging_level=logging.WARNING,
                    log_to_driver=log_to_driver,
                )
        else:
            # Serve's proxy (a process of the Ray instance started here, which inherits this
            # environment) answers JSON 503 not_ready until it can route to the Ingress
            os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
            node_ip = ray_node_ip(host)
            with loopback_node(node_ip == "127.0.0.1"), _callers_sigterm():
                ctx = ray.init(
                    num_cpus=num_cpus or os.cpu_count(),
                    include_dashboard=False,
                    dashboard_host="127.0.0.1",
                    runtime_env={"env_vars": env},
                    logging_level=logging.WARNING,
                    log_to_driver=log_to_driver,
                    _node_ip_address=node_ip,
                    _system_config={"metrics_report_interval_ms": METRICS_REPORT_INTERVAL_MS},
                )
            _OWN_RUN[:] = [record_run(home, ctx.address_info["session_dir"])]
    if _OWN_RUN:
        overrides = local_overrides(overrides)
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
    if _OWN_RUN:
        end_run(_OWN_RUN.pop())
