"""`mpic model calibrate-vlcache` (CLI process): VLCache's per-layer recompute ratios for one
model (VLCache section 4.1, Eq. 5-9; the search is `mpic.linker.calibration.vlcache`).

The proxy set: `--prompts` prompts of `--images` synthetic images each (distinct from the offline
benchmark's images), cached in the canonical context by the reference runner and linked after
new text before, between and after them, so the reused KV is mismatched (VLCache section 3.2).
Prints the ratios, the proxy-set fidelity of the result and of the static ratio with the same
budget, and the policy name to pass to `--policies` / the server; `--json` writes all of it
with the measured E(d, r) table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from mpic.engine.hf.reference_runner import ReferenceRunner
    from mpic.linker.calibration.vlcache import Calibration, ProxyPrompt

_INTROS = (
    "Here are a few photos a friend sent me from her holiday.",
    "My camera saved these frames during the afternoon.",
    "Please look carefully at the following images.",
    "These pictures come from an old family album.",
)
_QUESTIONS = (
    "Describe the main colours and say which image is the brightest.",
    "What changed from one picture to the next?",
    "Which of them would look best printed large, and why?",
    "Count the squares you can see in each picture.",
)
_IMAGE_OFFSET = 1000
"""Synthetic image indices start here, away from the offline benchmark's 0, 1, ..."""


def build_proxy_set(runner: ReferenceRunner, images: int, prompts: int) -> list[ProxyPrompt]:
    """`prompts` proxy prompts of `images` freshly cached images each."""
    from mpic.linker.calibration.vlcache import ProxyPrompt
    from mpic.linker.prompt import ImageRef, PromptPart
    from mpic.samples import synthetic_png

    proxies = []
    for p in range(prompts):
        first = _IMAGE_OFFSET + p * images
        ids = [runner.cache_image(synthetic_png(first + k)).entry_id for k in range(images)]
        parts: list[PromptPart] = [_INTROS[p % len(_INTROS)]]
        for k, entry_id in enumerate(ids):
            if k:
                parts.append(f"Picture number {k + 1}:")
            parts.append(ImageRef(entry_id))
        parts.append(_QUESTIONS[p % len(_QUESTIONS)])
        planned = runner.plan(parts)
        proxies.append(ProxyPrompt(planned.plan, planned.entries))
    return proxies


def print_result(cal: Calibration, tokens: int) -> None:
    """Per-layer ratios (and their token counts for an image of `tokens` tokens), proxy-set
    fidelity (calibrated vs static) and the policy name."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    layers = Table(title=f"VLCache calibration, r_bar = {cal.target:g}")
    for col in ("layer", "r_i", f"tokens of a {tokens}-token image"):
        layers.add_column(col, justify="right")
    for i, r in enumerate(cal.ratios, start=1):
        layers.add_row(str(i), f"{r:g}", str(int(r * tokens + 1e-9)))
    console.print(layers)
    fid = Table(title="Proxy set (last prompt token vs full recompute)")
    fid.add_column("policy", overflow="fold")
    for col in ("sum S_i (Eq. 6)", "logit MSE", "KL nats"):
        fid.add_column(col, justify="right")
    for name, row in cal.proxy.items():
        fid.add_row(name, f"{row['objective']:.4g}", f"{row['mse']:.4g}", f"{row['kl']:.4g}")
    console.print(fid)
    n = len(cal.ratios)
    console.print(f"sum r_i = {sum(cal.ratios):.4g} <= P_tar = {cal.target * n:.4g}")
    console.print(f"policy: {cal.policy}", soft_wrap=True)


def command(
    model: str = typer.Option(..., "--model", help="HF model folder."),
    target: float = typer.Option(
        0.1, "--target", help="Average ratio r_bar = P_tar / L (Eq. 7 is the sum over layers)."
    ),
    images: int = typer.Option(2, "--images", help="Images per proxy prompt."),
    prompts: int = typer.Option(4, "--prompts", help="Proxy prompts."),
    grid: str = typer.Option(
        "0.002:0.3:0.002",
        "--grid",
        help="Ratio grid, start:stop:step or r1,r2,... (default: Eq. 9's).",
    ),
    json_out: str = typer.Option(None, "--json", help="Write the calibration JSON here."),
    threads: int = typer.Option(1, "--threads", min=0, help="torch threads (0: default)."),
) -> None:
    """Calibrate VLCache's per-layer recompute ratios (greedy search, VLCache Eq. 5-9)."""
    import torch
    from rich.progress import Progress

    from mpic.engine.hf.reference_runner import ReferenceRunner
    from mpic.errors import MPICError
    from mpic.linker.calibration.vlcache import calibrate_with_progress, parse_grid

    try:
        levels = parse_grid(grid)
        if images < 1 or prompts < 1:
            raise ValueError("--images and --prompts must be at least 1")
        if not 0 < target <= levels[-1]:
            raise ValueError(f"--target must lie in (0, {levels[-1]:g}] (the grid's range)")
        if not Path(model, "config.json").is_file():
            raise ValueError(f"--model {model!r} is not an HF model folder")
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    if threads:
        torch.set_num_threads(threads)
    runner = ReferenceRunner(model)
    try:
        proxies = build_proxy_set(runner, images, prompts)
    except MPICError as exc:  # e.g. PromptTooLongError: too many images for the model
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    with Progress() as progress:
        cal = calibrate_with_progress(runner.adapter, proxies, target, levels, progress)
    print_result(cal, proxies[0].entries[0].num_tokens)
    if json_out:
        doc = {
            "model": model,
            "target_avg": target,
            "budget_sum": target * len(cal.ratios),
            "ratios": cal.ratios,
            "policy": cal.policy,
            "proxy": cal.proxy,
            "images_per_prompt": images,
            "prompts": prompts,
            "levels": cal.sensitivity.levels,
            "errors": cal.sensitivity.errors.tolist(),
        }
        Path(json_out).write_text(json.dumps(doc, indent=2))
