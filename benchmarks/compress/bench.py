"""`mpic bench compress` (CLI process): KV presses (`mpic.presses`) per budget on one engine:
memory held while decoding, decode time per token and fidelity against the uncompressed run.

Every request is link -> recompute (`--policy`, default mpic-32) -> compress -> decode. Prompts
are `--prompts` interleaved prompts of `--images` synthetic images each (`--items images`), or,
for a model with a trained language model, `--documents` standard-library passages linked as
cached text documents with a question (`--items documents`, `mpic.benchmarks.fidelity.bench`'s
prompts). Per prompt the uncompressed run (same policy, no press) decodes `--steps` greedy tokens
and is the reference. Per (press, budget), means over the prompts:

- `kv_bytes`: bytes of KV storage held while decoding (the compressed KV with room for the
  decoded tokens; the dense prompt KV is freed), `kv_bytes_full`: the uncompressed run's;
  `kv_reduction` = 1 - kv_bytes / kv_bytes_full;
- `decode_ms_per_token`: wall time per decoded token after the first (free-running greedy);
- `kl_mean`: mean over the first `--steps` steps of KL(p_ref || p_press), nats, teacher-forced on
  the reference's tokens so each step compares the same context;
- `top1_match`: share of those teacher-forced steps whose argmax is the reference token;
- `token_agreement`: share of the `--steps` free-running greedy positions equal to the
  reference's.

Both engines are driven through the `Engine` protocol by the same measuring code
(`mpic.benchmarks.compress.rows`: `CompressBench`, requests by the offline benchmark's `Driver`,
and `run_compress`); they differ in the engine `get_engine` returns. `--engine reference`: the
reference engine (`mpic.engine.hf.engine.ReferenceEngine`), every press exactly over the whole
prompt KV (`GenerateRequest.press`), teacher-forced by `GenerateRequest.forced_ids`, the KV bytes
its `Prefill.kv_bytes`. `--engine vllm` runs the presses' uniform variant as compressed image
entries on vLLM (`mpic.benchmarks.compress.vllm_bench`, whose docstring defines its columns).
Budget 1.0 is the uncompressed run itself (presses do nothing at 1.0). Writes a table, JSON
`{"engine", "model", "results": [...]}` and a PNG. docs/presses.md has measured results.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from mpic.benchmarks.compress.rows import CompressBench

DEFAULT_PRESSES = "elastic,mm-shiftkv,meda,window,snapkv"
DEFAULT_BUDGETS = "1,0.5,0.3,0.2,0.1"
KL_FLOOR = 1e-6
ROW_KEYS = (
    "press",
    "budget",
    "kv_bytes",
    "kv_bytes_full",
    "kv_reduction",
    "decode_ms_per_token",
    "kl_mean",
    "top1_match",
    "token_agreement",
    "prompt_tokens",
)


def print_table(rows: list[dict[str, Any]]) -> None:
    """Markdown table of the rows."""
    head = (
        "| press | budget | KV MiB held | KV reduction | decode ms/token | KL mean | top-1 match "
        "| greedy agreement |"
    )
    typer.echo(head)
    typer.echo("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        typer.echo(
            f"| {r['press']} | {r['budget']:g} | {r['kv_bytes'] / 2**20:.2f} | "
            f"{100 * r['kv_reduction']:.1f}% | {r['decode_ms_per_token']:.1f} | "
            f"{r['kl_mean']:.4f} | {r['top1_match']:.2f} | {r['token_agreement']:.2f} |"
        )


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """PNG: KL, greedy agreement and KV held against the budget, one line per press."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = next((r for r in rows if r["press"] == "none"), None)
    fig, (ax_k, ax_a, ax_m) = plt.subplots(1, 3, figsize=(15, 4))
    for press in dict.fromkeys(r["press"] for r in rows if r["press"] != "none"):
        mine = sorted(
            [r for r in rows if r["press"] == press] + ([base] if base else []),
            key=lambda r: r["budget"],
        )
        xs = [r["budget"] for r in mine]
        ax_k.plot(xs, [max(r["kl_mean"], KL_FLOOR) for r in mine], marker="o", label=press)
        ax_a.plot(xs, [r["token_agreement"] for r in mine], marker="o", label=press)
        ax_m.plot(xs, [r["kv_bytes"] / 2**20 for r in mine], marker="o", label=press)
    ax_k.set(xlabel="budget", ylabel="KL(ref || press), nats", yscale="log",
             title=f"Mean KL over decode steps (0 at {KL_FLOOR:g})")  # fmt: skip
    ax_a.set(xlabel="budget", ylabel="share of positions", title="Greedy agreement")
    ax_m.set(xlabel="budget", ylabel="MiB", title="KV held while decoding")
    ax_k.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def open_bench(engine: str, model: str, device: str, press: str) -> CompressBench:
    """The measuring code over the engine called `engine` (`get_engine`; `device`: the
    reference engine's); exit 2 for a device torch does not see, or a model whose items vLLM
    cannot shorten by `press`."""
    from mpic.benchmarks.compress.rows import CompressBench
    from mpic.benchmarks.offline.engines import get_engine

    if engine == "reference":
        try:
            return CompressBench(get_engine("reference", model, device))
        except ValueError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(code=2) from exc
    from mpic.benchmarks.compress.vllm_bench import VllmCompressBench
    from mpic.engine.vllm.presses import check_press
    from mpic.errors import InvalidRequestError
    from mpic.model_spec import ModelSpec

    try:
        check_press(ModelSpec.from_pretrained(model), press, 0.5)
    except InvalidRequestError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    return VllmCompressBench(model)


def command(
    model: str = typer.Option(..., "--model", help="HF model folder."),
    engine: str = typer.Option(
        "reference", "--engine", help="reference (every press exactly) | vllm (uniform variant)."
    ),
    presses: str = typer.Option(DEFAULT_PRESSES, "--presses", help="Press names, comma-separated."),
    budgets: str = typer.Option(DEFAULT_BUDGETS, "--budgets", help="Budgets in (0, 1]."),
    policy: str = typer.Option("mpic-32", "--policy", help="Linking policy (docs/linker.md)."),
    items: str = typer.Option("images", "--items", help="images | documents"),
    count: int = typer.Option(4, "--images", "--documents", min=1, help="Items per prompt."),
    prompts: int = typer.Option(2, "--prompts", min=1, help="Prompts (figures are means)."),
    steps: int = typer.Option(32, "--steps", min=2, help="Decoded tokens per run."),
    json_out: str = typer.Option(None, "--json", help="Write the results JSON here."),
    plot_out: str = typer.Option(None, "--plot", help="Write the PNG plot here."),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda"),
    threads: int = typer.Option(1, "--threads", min=0, help="torch threads (0: default)."),
) -> None:
    """Benchmark KV presses: memory, decode time and fidelity per budget."""
    import torch

    from mpic.benchmarks.compress.rows import run_compress
    from mpic.linker.policies import get_policy
    from mpic.presses.registry import check_budget, get_press

    try:
        names = [p.strip() for p in presses.split(",") if p.strip()]
        for n in names:
            get_press(n)
        bs = sorted({check_budget(float(b)) for b in budgets.split(",") if b.strip()}, reverse=True)
        get_policy(policy)
        if engine not in ("reference", "vllm"):
            raise ValueError(f"--engine {engine!r}: reference or vllm")
        if items not in ("images", "documents"):
            raise ValueError("--items must be images or documents")
        if not names or not bs:
            raise ValueError("--presses and --budgets must not be empty")
        if not Path(model, "config.json").is_file():
            raise ValueError(f"--model {model!r} is not an HF model folder")
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    torch.set_grad_enabled(False)
    if threads:
        torch.set_num_threads(threads)
    bench = open_bench(engine, model, device, names[0])
    try:
        rows = run_compress(bench, bench.prompts(prompts, count, items), policy, names, bs, steps)
    finally:
        bench.close()
    print_table(rows)
    if json_out:
        doc = {
            "engine": engine,
            "model": model,
            "policy": policy,
            "items": items,
            "items_per_prompt": count,
            "prompts": prompts,
            "steps": steps,
            "device": device,
            "results": [{k: r[k] for k in ROW_KEYS} for r in rows],
        }
        Path(json_out).write_text(json.dumps(doc, indent=2))
    if plot_out:
        plot(rows, plot_out)
