"""`mpic serve [--config FILE] [--host H] [--port N] [--address RAY]` (CLI process): run the Ray
Serve application until SIGINT/SIGTERM, then shut it down cleanly.

No config: the embedded default (small random model written to .mpic/models on first use,
filesystem store under .mpic/store, dev API keys, see docs/serving.md). A config is a
`serve build`-style YAML (deployments/serve_config.yaml) or a bare ServeAppConfig; the
per-deployment options of its application's `deployments:` section (replicas, autoscaling,
resources: Serve's own schema) are applied over those of `args`.

Without `--address` a Ray instance is started in this process and torn down on exit (Serve,
every replica, Ray's own processes: none is left behind); with `--address` the application is
deployed on that running cluster and deleted from it on exit (the cluster keeps running).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import typer
import yaml
from pydantic import ValidationError


def serve_overrides(path: str | None) -> dict[str, dict[str, Any]]:
    """name -> options of the first application's `deployments:` section of a `serve build`
    config ({} for a bare ServeAppConfig or no config)."""
    if path is None:
        return {}
    data = yaml.safe_load(Path(path).read_text()) or {}
    apps = data.get("applications") or [{}]
    out: dict[str, dict[str, Any]] = {}
    for dep in apps[0].get("deployments") or []:
        opts = {k: v for k, v in dep.items() if k != "name"}
        if opts:
            out[dep["name"]] = opts
    return out


def _terminate(signum: int, _frame: object) -> None:
    """SIGTERM behaves like Ctrl-C: unwind through the shutdown in `command`."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def command(
    config: str = typer.Option(None, "--config", help="serve config YAML (default: embedded)."),
    host: str = typer.Option("127.0.0.1", "--host", help="HTTP bind address (0.0.0.0: all)."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="HTTP port."),
    address: str = typer.Option(
        None,
        "--address",
        envvar="RAY_ADDRESS",
        help="Join this running Ray cluster (auto, host:6379, ray://host:10001) instead of "
        "starting one.",
    ),
) -> None:
    """Start the Ray Serve application and serve until SIGINT/SIGTERM."""
    from mpic.deployments.config import DEPLOYMENT_NAMES, load_config
    from mpic.deployments.local import start_local, stop_local
    from mpic.errors import MPICError

    try:
        cfg = load_config(config)
        overrides = serve_overrides(config)
    except (MPICError, ValidationError, OSError, yaml.YAMLError) as exc:
        typer.echo(f"error: bad config {config}: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    unknown = sorted(set(overrides) - set(DEPLOYMENT_NAMES))
    if unknown:
        typer.echo(
            f"error: bad config {config}: unknown deployment(s) {unknown}; "
            f"known: {list(DEPLOYMENT_NAMES)}",
            err=True,
        )
        raise typer.Exit(code=2)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        url = start_local(cfg, port=port, host=host, address=address, overrides=overrides)
        signal.signal(signal.SIGTERM, _terminate)  # ray.init installs its own (it aborts)
        typer.echo(
            f"MPIC serve ready at {url} (auth mode: {cfg.auth.mode}); Ctrl-C or SIGTERM stops it"
        )
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        typer.echo("stopping")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the teardown
        stop_local(cfg.name if address else None)
        signal.signal(signal.SIGTERM, previous)
    typer.echo("stopped")
