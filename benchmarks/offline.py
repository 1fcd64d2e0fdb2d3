"""`mpic bench offline` (CLI process): TTFT and fidelity per policy and image count.
Placeholder until the core-engine issue lands it."""

import typer


def command(
    model: str = typer.Option(..., "--model", help="HF model folder."),
    engine: str = typer.Option("reference", "--engine", help="reference | vllm"),
    images: str = typer.Option("1,2,4,8", "--images"),
    policies: str = typer.Option("full,prefix,full-reuse,cacheblend-15,mpic-32,vlcache-0.1", "--policies"),
    repeats: int = typer.Option(3, "--repeats"),
    json_out: str = typer.Option(None, "--json"),
    plot: str = typer.Option(None, "--plot"),
) -> None:
    """Run the offline TTFT/fidelity benchmark."""
    raise typer.Exit(code=2)
