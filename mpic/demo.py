"""`mpic demo` (CLI process). Placeholder until the core-engine issue lands it."""

import typer


def command() -> None:
    """Run the README's main job."""
    raise typer.Exit(code=2)
