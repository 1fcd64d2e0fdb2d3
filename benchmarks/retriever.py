"""`mpic bench retriever` (CLI process): FAISS build time, latency and recall.
Placeholder until the retriever issue lands it."""

import typer


def command(
    vectors: str = typer.Option("10000,100000", "--vectors"),
    dim: int = typer.Option(512, "--dim"),
    json_out: str = typer.Option(None, "--json"),
) -> None:
    """Run the retriever benchmark."""
    raise typer.Exit(code=2)
