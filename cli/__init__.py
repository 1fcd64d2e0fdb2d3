"""`mpic` command line (CLI process). Each subcommand lives beside the code it drives and imports
its heavy dependencies (torch, vLLM, Ray) inside the function, so `mpic --help` stays fast."""

from __future__ import annotations

import typer

from mpic.benchmarks import retriever as bench_retriever
from mpic.benchmarks import routing as bench_routing
from mpic.benchmarks import storage as bench_storage
from mpic.benchmarks.compress import bench as bench_compress
from mpic.benchmarks.fidelity import bench as bench_fidelity
from mpic.benchmarks.linking import bench as bench_linking
from mpic.benchmarks.load import bench as bench_load
from mpic.benchmarks.offline import bench as bench_offline
from mpic.benchmarks.online import bench as bench_online
from mpic.cli import calibrate_scout, calibrate_vlcache, demo
from mpic.cli import serve as serve_command
from mpic.engine.tiny import models as tiny_models
from mpic.engine.tiny import smollm2 as trained_models

app = typer.Typer(
    no_args_is_help=True, help="MPIC serve: position-independent multimodal KV caching."
)


def _print_version(value: bool) -> None:
    if value:
        from mpic import installed_version

        typer.echo(installed_version())
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(
        False,
        "--version",
        callback=_print_version,
        is_eager=True,
        help="Print the installed mpic-serve version and exit (as `vllm --version`).",
    ),
) -> None:
    """MPIC serve: position-independent multimodal KV caching."""


model_app = typer.Typer(no_args_is_help=True, help="Model utilities.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (each writes JSON and a PNG plot).")
app.add_typer(model_app, name="model")
app.add_typer(bench_app, name="bench")

model_app.command("make-tiny")(tiny_models.make_tiny_command)
model_app.command("import")(trained_models.import_command)
model_app.command("calibrate-vlcache")(calibrate_vlcache.command)
model_app.command("calibrate-scout")(calibrate_scout.command)
bench_app.command("offline")(bench_offline.command)
bench_app.command("storage")(bench_storage.command)
bench_app.command("retriever")(bench_retriever.command)
bench_app.command("routing")(bench_routing.command)
bench_app.command("load")(bench_load.command)
bench_app.command("fidelity")(bench_fidelity.command)
bench_app.command("compress")(bench_compress.command)
bench_app.command("linking")(bench_linking.command)
bench_app.command("online")(bench_online.command)
app.command("demo")(demo.command)
app.command("serve")(serve_command.command)


def main() -> None:
    """Entry point of the `mpic` console script."""
    app()
