"""`mpic serve [MODEL] [vLLM flags] [--config FILE] [--address RAY]` (CLI process): run the Ray
Serve application until SIGINT/SIGTERM, then shut it down cleanly.

The flags are `vllm serve`'s for what means the same here (`--served-model-name`,
`--max-model-len`, `--gpu-memory-utilization`, `--tensor-parallel-size`, `--dtype`, `--api-key`,
`--chat-template`, `--block-size`, `--max-num-seqs`, `--max-num-batched-tokens`,
`--[no-]enable-prefix-caching`, `--[no-]enforce-eager`, `--seed`, `--host`, `--port`), grouped
in `--help` as vLLM groups them, applied over the config by `mpic.cli.serve_flags` (a flag the
configured engine cannot honour, or an unknown flag: exit status 2).

No config: the embedded default (small random model written to .mpic/models on first use,
filesystem store under .mpic/store, dev API keys, see docs/serving.md). A config is a
`serve build`-style YAML (deployments/serve_config.yaml) or a bare ServeAppConfig; the
per-deployment options of its application's `deployments:` section (replicas, autoscaling,
resources: Serve's own schema) are applied over those of `args`.

Serve's HTTP proxy answers JSON 503 `not_ready` from its first connection until it can route to
the Ingress (`mpic.deployments.http.startup_gate`, installed by `start_local` through the
environment of the Ray instance it starts); then the Ingress does until every deployment can serve.

Without `--address` a Ray instance is started in this process and torn down on exit (Serve,
every replica, Ray's own processes: none is left behind), and a start ends what a crashed run
left (`mpic.deployments.local_runs`); with `--address` the application is deployed on that
running cluster and deleted from it on exit (the cluster keeps running). SIGINT and SIGTERM stop
it whatever dispositions and signal mask it inherited (`cmd &` in a script starts it with SIGINT
ignored).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Annotated, Any

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


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _terminate(signum: int, _frame: object) -> None:
    """SIGINT and SIGTERM: unwind through the shutdown in `command`."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _handle_stop_signals() -> dict:
    """Make SIGINT and SIGTERM stop the server whatever this process inherited: a shell script's
    `mpic serve ... &` starts it with SIGINT ignored (Python then installs no Ctrl-C handler) and
    a parent may leave either signal blocked. Handlers, unlike an ignored disposition, are reset
    to the default in the processes Ray starts from here. Returns what to restore."""
    saved = {"mask": signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)}
    for sig in STOP_SIGNALS:
        saved[sig] = signal.signal(sig, _terminate)
    return saved


def _restore_signals(saved: dict) -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, saved[sig])
    signal.pthread_sigmask(signal.SIG_SETMASK, saved["mask"])


MPIC_PANEL, FRONTEND, MODEL_PANEL = "MPIC", "Frontend", "ModelConfig"
CACHE, PARALLEL, SCHEDULER = "CacheConfig", "ParallelConfig", "SchedulerConfig"
"""Help panels: vLLM's argument groups (`vllm serve --help`), and MPIC's own."""


def command(
    model: str = typer.Argument(
        None,
        help="Model folder or s3://bucket/prefix (vLLM's MODEL); its family is read from its "
        "config.json. Default: the config's, else the embedded small random model.",
        show_default=False,
    ),
    config: str = typer.Option(
        None,
        "--config",
        help="serve config YAML (default: embedded); flags override it.",
        rich_help_panel=MPIC_PANEL,
    ),
    address: str = typer.Option(
        None,
        "--address",
        envvar="RAY_ADDRESS",
        help="Join this running Ray cluster (auto, host:6379, ray://host:10001) instead of "
        "starting one.",
        rich_help_panel=MPIC_PANEL,
    ),
    host: str = typer.Option(
        "127.0.0.1", "--host", help="HTTP bind address (0.0.0.0: all).", rich_help_panel=FRONTEND
    ),
    port: int = typer.Option(
        8000, "--port", min=1, max=65535, help="HTTP port.", rich_help_panel=FRONTEND
    ),
    api_key: Annotated[
        list[str] | None,
        typer.Option(
            "--api-key",
            help="API key clients must send as Bearer token; repeat or comma-separate for "
            "several (turns the dev keys off).",
            rich_help_panel=FRONTEND,
        ),
    ] = None,
    chat_template: str = typer.Option(
        None,
        "--chat-template",
        help="Chat template file (or inline Jinja) used instead of the model's.",
        rich_help_panel=FRONTEND,
    ),
    served_model_name: Annotated[
        list[str] | None,
        typer.Option(
            "--served-model-name",
            help="Model name(s) of the API (repeat for aliases); default: MODEL as given.",
            rich_help_panel=MODEL_PANEL,
        ),
    ] = None,
    max_model_len: str = typer.Option(
        None,
        "--max-model-len",
        help="Context length in tokens (4096, 4k, 4K); default: the model's.",
        rich_help_panel=MODEL_PANEL,
    ),
    dtype: str = typer.Option(
        None,
        "--dtype",
        help="Weights dtype: auto, half, float16, bfloat16, float, float32 (auto: float32).",
        rich_help_panel=MODEL_PANEL,
    ),
    gpu_memory_utilization: float = typer.Option(
        None,
        "--gpu-memory-utilization",
        min=0.0,
        max=1.0,
        help="Fraction of GPU memory vLLM may use (vLLM engine).",
        rich_help_panel=CACHE,
    ),
    block_size: int = typer.Option(
        None,
        "--block-size",
        help="KV block size in tokens (vLLM engine; CPU: multiple of 32).",
        rich_help_panel=CACHE,
    ),
    tensor_parallel_size: int = typer.Option(
        None,
        "--tensor-parallel-size",
        "-tp",
        min=1,
        help="GPUs one model is split over (vLLM engine).",
        rich_help_panel=PARALLEL,
    ),
    max_num_seqs: int = typer.Option(
        None,
        "--max-num-seqs",
        min=1,
        help="Most sequences vLLM runs in one batch (vLLM engine).",
        rich_help_panel=SCHEDULER,
    ),
    max_num_batched_tokens: int = typer.Option(
        None,
        "--max-num-batched-tokens",
        min=1,
        help="Most tokens vLLM runs in one step (vLLM engine; default: vLLM's).",
        rich_help_panel=SCHEDULER,
    ),
    enable_prefix_caching: bool = typer.Option(
        None,
        "--enable-prefix-caching/--no-enable-prefix-caching",
        help="vLLM's own prefix caching (vLLM engine; default: on).",
        show_default=False,
        rich_help_panel=CACHE,
    ),
    enforce_eager: bool = typer.Option(
        None,
        "--enforce-eager/--no-enforce-eager",
        help="Run vLLM's model eagerly, no torch.compile or CUDA graphs (vLLM engine; "
        "default: eager, the faster start).",
        show_default=False,
        rich_help_panel=MODEL_PANEL,
    ),
    seed: int = typer.Option(
        None,
        "--seed",
        help="vLLM's random seed (vLLM engine; a request's `seed` still wins).",
        rich_help_panel=MODEL_PANEL,
    ),
) -> None:
    """Serve MODEL with MPIC's KV linking behind an OpenAI/vLLM-compatible API (vLLM's flag
    names), until SIGINT/SIGTERM."""
    import os

    from mpic.cli.serve_flags import FlagError, ServeFlags, api_keys, apply_flags, key_env
    from mpic.deployments.config import load_config
    from mpic.deployments.deployment_config import DEPLOYMENT_NAMES
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
    flags = ServeFlags(
        model=model,
        served_model_name=list(served_model_name or []),
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        tensor_parallel_size=tensor_parallel_size,
        dtype=dtype,
        api_key=list(api_key or []),
        chat_template=chat_template,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=enable_prefix_caching,
        enforce_eager=enforce_eager,
        seed=seed,
    )
    try:
        keys = api_keys(flags.api_key)
        cfg = apply_flags(cfg, flags)
    except FlagError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    if keys:  # passed to every replica with the environment (deployments.local)
        os.environ["MPIC_API_KEYS"] = key_env(keys, os.environ.get("MPIC_API_KEYS"))
    saved = _handle_stop_signals()
    try:
        url = start_local(cfg, port=port, host=host, address=address, overrides=overrides)
        typer.echo(
            f"MPIC serve ready at {url}: model {cfg.engine.served_names[0]!r} "
            f"({cfg.engine.kind} engine, auth mode: {cfg.auth.mode}); Ctrl-C or SIGTERM stops it"
        )
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        typer.echo("stopping")
    finally:
        for sig in STOP_SIGNALS:  # a second signal must not cut the teardown short (SIGKILL
            signal.signal(sig, signal.SIG_IGN)  # does; the next start ends what it left)
        stop_local(cfg.name if address else None)
        _restore_signals(saved)
    typer.echo("stopped")
