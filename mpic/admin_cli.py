"""`mpic-admin` (CLI process). Placeholder until the retriever issue lands it."""

import typer

app = typer.Typer(no_args_is_help=True, help="MPIC administration: dynamic library.")


def main() -> None:
    """Entry point of the `mpic-admin` console script."""
    app()
