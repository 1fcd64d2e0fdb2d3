"""`mpic serve` (CLI process). Placeholder until the Ray Serve issue lands it."""

import typer


def command(
    config: str = typer.Option(None, "--config"),
    port: int = typer.Option(8000, "--port"),
) -> None:
    """Start the Ray Serve application locally."""
    raise typer.Exit(code=2)
