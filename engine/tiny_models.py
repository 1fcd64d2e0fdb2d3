"""`mpic model make-tiny` (CLI process). Placeholder until the core-engine issue lands it."""

import typer


def make_tiny_command(
    family: str = typer.Option(..., "--family", help="llava | qwen2-vl"),
    size: str = typer.Option("tiny", "--size", help="tiny | small"),
    out: str = typer.Option(..., "--out"),
) -> None:
    """Write a random-weight HF model folder."""
    raise typer.Exit(code=2)
