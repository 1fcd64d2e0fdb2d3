"""`mpic bench storage` (CLI process): entry load throughput per tier vs raw reads.
Placeholder until the storage issue lands it."""

import typer


def command(
    sizes: str = typer.Option("1,10,100", "--sizes", help="Entry sizes in MB."),
    json_out: str = typer.Option(None, "--json"),
) -> None:
    """Run the storage benchmark."""
    raise typer.Exit(code=2)
