"""`mpic model make-tiny`: random-weight HF model folders the project writes itself (CLI process,
test processes).

No weights can be downloaded here, so tests and benchmarks run on models written by this module:
an HF folder (config.json, model.safetensors, tokenizer, processor configs, chat template) that
transformers (`AutoConfig`, `AutoProcessor`, the model class) and vLLM both load. Weights are
seeded normal draws (std = hidden**-0.5, with gains on q/k and the LM head so attention and the
first-token distribution are peaked but not one-hot); the tokenizer is trained offline
(`engine/tiny/tokenizer.py`). Shapes, configs and processors per (family, size) are in
`engine/tiny/configs.py`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import typer

from mpic.engine.tiny.configs import (
    FAMILIES,
    SHAPES,
    SIZES,
    llava_config,
    llava_next_config,
    processor,
    qwen2vl_config,
    qwen25vl_config,
)
from mpic.engine.tiny.weights import write_weights
from mpic.types import ModelFamily

logger = logging.getLogger(__name__)

_GAINS: dict[str, float] = {"q_proj": 1.5, "k_proj": 1.5, "lm_head": 3.0}
"""Std multipliers of language-model weights: q/k x1.5 give attention logits of std ~2 (peaked,
not uniform); lm_head x3 gives output logits of std ~3, so the first-token entropy is a few nats
as in trained models, not log(vocab) (KL fidelity then measures something)."""


def _init_weights(model, seed: int, std: float) -> None:
    """Seeded N(0, std * gain) for every matrix/embedding/conv and CLIP's class embedding; zero
    biases; unit norm weights. Drawn where the model lives: deterministic across runs and machines
    on the CPU generator; a CUDA model draws on its GPU's generator (fast; other numbers)."""
    import torch

    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("bias"):
                param.zero_()
            elif param.ndim >= 2 or name.endswith(("class_embedding", "image_newline")):
                module = name.split(".")[-2]
                text = "language_model" in name or module == "lm_head"
                gain = _GAINS.get(module, 1.0) if text else 1.0
                draw = torch.randn(param.shape, generator=gen, device=device)
                param.copy_(draw * (std * gain))
            else:
                param.fill_(1.0)


def default_device(size: str) -> str:
    """Where `make_tiny` draws weights by default: a GPU for `7b` when there is one, else the CPU
    (tiny and small stay on the CPU generator: the same weights on every machine)."""
    import torch

    return "cuda" if size == "7b" and torch.cuda.is_available() else "cpu"


def make_tiny(
    family: ModelFamily,
    size: str,
    out: str | Path,
    seed: int = 0,
    device: str | None = None,
    dtype: str | None = None,
    layers: int | None = None,
    patch_size: int | None = None,
) -> Path:
    """Write a random-weight HF folder for `family` at `size` into `out`; returns its path.

    device: where weights are drawn (default `default_device(size)`); dtype: "float32" or
    "bfloat16" as saved (default bfloat16 for `7b`, float32 otherwise); layers: the language
    model's decoder layers instead of the size's (e.g. `small` at 7B's 32 layers: per-request
    costs weighed at a real depth on a CPU); patch_size: the vision tower's patch side instead of
    the size's (tokens per image (image_size / patch_size)^2, merged 2x2 for Qwen: `small` LLaVA
    at 14 has LLaVA-1.5's 576 tokens per image instead of 144). The folder is assembled
    in a temporary sibling and renamed into place, so a failure never leaves a half-written model
    behind. Raises ValueError on an unknown family, size or dtype.
    """
    if family not in FAMILIES or size not in SIZES:
        raise ValueError(
            f"unknown model {family!r}/{size!r}: family must be one of {list(FAMILIES)}, "
            f"size one of {list(SIZES)}"
        )
    dtype = dtype or ("bfloat16" if size == "7b" else "float32")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"unknown dtype {dtype!r}: float32 or bfloat16")
    if layers is not None and not 1 <= layers <= 128:
        raise ValueError(f"layers must be in [1, 128], got {layers}")
    side = SHAPES[(family, size)].image_size
    grid = side // patch_size if patch_size else 0
    if patch_size is not None and (
        patch_size < 1 or side % patch_size or (family.startswith("qwen") and grid % 2)
    ):
        merged = " into an even grid (Qwen merges 2x2)" if family.startswith("qwen") else ""
        raise ValueError(f"patch size {patch_size} must divide the image side {side}{merged}")
    import torch
    from transformers import (
        LlavaForConditionalGeneration,
        LlavaNextForConditionalGeneration,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
    )

    device = device or default_device(size)
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but torch sees no CUDA device")

    from mpic.engine.tiny.tokenizer import build_tokenizer

    shape = SHAPES[(family, size)]
    if layers is not None:
        shape = dataclasses.replace(shape, layers=layers)
    if patch_size is not None:
        shape = dataclasses.replace(shape, patch_size=patch_size)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(family, shape.vocab, seed=seed)
    vocab = tokenizer.get_vocab()
    build, model_cls = {
        "llava": (llava_config, LlavaForConditionalGeneration),
        "llava-next": (llava_next_config, LlavaNextForConditionalGeneration),
        "qwen2-vl": (qwen2vl_config, Qwen2VLForConditionalGeneration),
        "qwen2.5-vl": (qwen25vl_config, Qwen2_5_VLForConditionalGeneration),
    }[family]
    config: Any = build(shape, vocab)
    config.dtype = dtype
    config.architectures = [model_cls.__name__]
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        stage = Path(tmp) / "model"
        stage.mkdir()
        with torch.device(device):
            model = model_cls(config).to(getattr(torch, dtype)).eval()
        _init_weights(model, seed, std=shape.hidden**-0.5)
        config.save_pretrained(stage)
        write_weights(model, family, stage)
        processor(family, shape, tokenizer, size).save_pretrained(stage)
        (stage / "mpic_tiny.json").write_text(
            json.dumps(
                {
                    "family": family,
                    "size": size,
                    "seed": seed,
                    "dtype": dtype,
                    "device": device,
                    "layers": shape.layers,
                    "patch_size": shape.patch_size,
                },
                indent=1,
            )
        )
        if out.exists():
            out.rmdir()
        shutil.move(str(stage), str(out))
    logger.info("wrote %s %s model to %s", family, size, out)
    return out


def make_tiny_command(
    family: str = typer.Option(..., "--family", help="llava | llava-next | qwen2-vl | qwen2.5-vl"),
    size: str = typer.Option(
        "tiny", "--size", help="tiny (unit tests) | small (CPU benchmarks) | 7b (GPU benchmarks)"
    ),
    out: str = typer.Option(..., "--out", help="folder to create (must not exist or be empty)"),
    seed: int = typer.Option(0, "--seed", help="random seed of weights and tokenizer corpus"),
    device: str = typer.Option(
        None, "--device", help="draw weights on cpu | cuda (default: cuda for 7b if present)"
    ),
    dtype: str = typer.Option(
        None, "--dtype", help="float32 | bfloat16 (default: bfloat16 for 7b, else float32)"
    ),
    lm: str = typer.Option(
        None, "--lm", help="smollm2: the trained SmolLM2-135M as the language model (llava)"
    ),
    layers: int = typer.Option(
        None, "--layers", help="language model decoder layers (default: the size's; 7b has 32)"
    ),
    patch_size: int = typer.Option(
        None,
        "--patch-size",
        help="vision patch side (default: the size's; llava small 14: 576 tokens per image)",
    ),
) -> None:
    """Write a random-weight HF model folder (config, weights, tokenizer, processor)."""
    if lm is not None and (layers is not None or patch_size is not None):
        flag = "--layers" if layers is not None else "--patch-size"
        typer.echo(f"error: {flag} shapes a random model; not with --lm", err=True)
        raise typer.Exit(code=2)
    if lm is not None:  # a trained language model behind a random vision tower
        from mpic.engine.tiny.smollm2 import make_with_trained_lm_command

        make_with_trained_lm_command(family, lm, out, seed)
        return
    if family not in FAMILIES:
        choices = ", ".join(FAMILIES)
        typer.echo(f"error: unknown --family {family!r}; choose one of {choices}", err=True)
        raise typer.Exit(code=2)
    if size not in SIZES:
        typer.echo(f"error: unknown --size {size!r}; choose one of {', '.join(SIZES)}", err=True)
        raise typer.Exit(code=2)
    from rich.console import Console

    try:
        with Console(stderr=True).status(f"writing {family} {size} model to {out} ..."):
            path = make_tiny(family, size, out, seed, device, dtype, layers, patch_size)  # type: ignore[arg-type]
    except (FileExistsError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    except OSError as exc:
        typer.echo(f"error: cannot write {out}: {exc}", err=True)
        raise typer.Exit(code=1) from exc
    typer.echo(f"wrote {family} {size} model to {path}")
