"""`mpic serve [--config FILE] [--port N]` (CLI process): run the Ray Serve application locally.

No config: the embedded default (tiny random LLaVA written to .mpic/models on first use,
filesystem store under .mpic/store, reference engine, dev API keys, see docs/serving.md).
A config is a `serve build`-style YAML (deployments/serve_config.yaml) or a bare ServeAppConfig.
"""

from __future__ import annotations

import time

import typer
from pydantic import ValidationError


def command(
    config: str = typer.Option(None, "--config", help="serve config YAML (default: embedded)."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="HTTP port on 127.0.0.1."),
) -> None:
    """Start the Ray Serve application locally and serve until Ctrl-C."""
    from mpic.deployments.config import load_config
    from mpic.deployments.local import start_local, stop_local
    from mpic.errors import MPICError

    try:
        cfg = load_config(config)
    except (MPICError, ValidationError) as exc:
        typer.echo(f"error: bad config {config}: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    try:
        url = start_local(cfg, port=port)
        typer.echo(f"MPIC serve ready at {url} (auth mode: {cfg.auth.mode}); Ctrl-C stops it")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        typer.echo("stopping")
    finally:
        stop_local()
