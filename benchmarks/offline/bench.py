"""`mpic bench offline` (CLI process): TTFT and fidelity per policy and image count (MPIC paper
section 5.2, Fig. 9, on our own model).

Prompts as in the paper: n images are cached in advance, then a new question whose text comes
before, between and after the images. Per (policy, n): median TTFT over `repeats` (entries in
memory), prompt tokens, recomputed tokens, KL(full || policy) of the first-token distribution
and the agreement of the first 16 greedy tokens with `full` on the same prompt. Writes a table
on stdout, JSON `{"engine", "model", "results": [...]}` and a PNG of TTFT and KL vs n. Rows also
carry `cpu_ms`, the CPU time of the timed request: on a shared, busy host wall-clock TTFT is
noisy while the CPU time still measures the work.

Any `mpic.engine.protocol.Engine` is driven through the protocol alone
(`mpic.benchmarks.offline.engines.Driver`: TTFT is the backend's `Prefill.ttft_s`, from the
request to its first token); the hooks below are the protocol's optional members, read with
getattr.

The floor: for engines that can time a plain forward (`Engine.floor_s`), each row also
carries `floor_ms`, a plain forward of the row's number of recomputed tokens alone, and
`floor_ratio` = TTFT / floor: how close the selective pass (plus linking and planning) comes to
the cost of its own recomputation. `--device cuda --dtype bfloat16` runs the reference engine on
a GPU (docs/kernels.md has the GPU commands).

Where the time goes (`mpic.benchmarks.offline.op_counts`), for engines that run their model in this
process (`Engine.prefill_fn`; None for the vLLM engine): after a row's timed runs, one
untimed prefill counted op by op gives `aten_ops` (per prefill), `aten_ops_per_layer`, `syncs`
(device->host synchronisations) and `h2d_copies` (both None on the CPU, where they cannot be
told apart); on CUDA one more, profiled, gives `gpu_busy_ms` (union of kernel intervals),
`gpu_busy_share` (of that run's wall time) and `kernels`. Every row carries `eager_falls`
(compiled calls, FlexAttention's among them, that fell back to eager during the row's runs)
and `compiled_graphs` (graphs dynamo holds for this process's compiled functions after the row;
both from `mpic.kernels.compiled.compile_stats`). Each policy is warmed up at the row's shape before
timing: twice on CUDA (compilation, autotuning), once on the CPU. `--top-ops N` prints each
row's top N ops (the profiler's by device time on CUDA, the counted aten ops on the CPU).
"""

from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from mpic.samples import interleaved_prompt, synthetic_png

if TYPE_CHECKING:  # torch loads inside the command so `mpic --help` stays fast
    import torch

    from mpic.engine.protocol import Engine
    from mpic.linker.prompt import PromptPart
    from mpic.types import CacheEntry

logger = logging.getLogger(__name__)
GREEDY_TOKENS = 16
KL_FLOOR = 1e-6


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(p_ref || p) of the two first-token distributions (nats)."""
    import torch

    ref, other = torch.log_softmax(ref_logits.double(), -1), torch.log_softmax(logits.double(), -1)
    return max(0.0, float((ref.exp() * (ref - other)).sum()))


def _median_cpu_ms(runs: list) -> float | None:
    """Median CPU time of the timed runs (None if the engine does not report it)."""
    cpu = [r.cpu_s for r in runs if r.cpu_s is not None]
    return statistics.median(cpu) * 1000 if cpu else None


def add_floors(engine: Engine, rows: list[dict], repeats: int) -> None:
    """Set `floor_ms` and `floor_ratio` on every row (None where the engine has no floor)."""
    floor = getattr(engine, "floor_s", None)
    cache: dict[int, float] = {}
    for row in rows:
        tokens = row["recomputed_tokens"]
        if floor is not None and tokens not in cache:
            cache[tokens] = floor(tokens, repeats) * 1000
        row["floor_ms"] = cache.get(tokens)
        row["floor_ratio"] = row["ttft_ms"] / cache[tokens] if tokens in cache else None


OP_FIELDS = (
    "aten_ops",
    "aten_ops_per_layer",
    "syncs",
    "h2d_copies",
    "gpu_busy_ms",
    "gpu_busy_share",
    "kernels",
)
"""Row fields from the untimed counted (and, on CUDA, profiled) prefill; None where the engine
cannot run a prefill in this process."""


def _on_cuda(engine: Engine) -> bool:
    """Whether the engine's model runs on a CUDA device in this process."""
    return str(getattr(engine, "device", "cpu")).startswith("cuda")


def op_fields(
    engine: Engine,
    parts: Sequence[PromptPart],
    policy: str,
    top_ops: int = 0,
    label: str = "",
    entries: Mapping[str, CacheEntry] | None = None,
) -> dict:
    """`OP_FIELDS` of one untimed prefill of `parts` under `policy` (over `entries`) counted
    with `count_ops`, plus, on CUDA, one more under `profile_gpu`; all None for an engine
    without `prefill_fn`. top_ops > 0 prints the top ops under `label`: the profiler's table by
    device time on CUDA (not for `full`), else the most frequent ops."""
    from mpic.benchmarks.offline.engines import prefill_request
    from mpic.benchmarks.offline.op_counts import count_ops, profile_gpu

    fields: dict = dict.fromkeys(OP_FIELDS)
    make = getattr(engine, "prefill_fn", None)
    if make is None:
        return fields
    prefill = make(prefill_request(parts, policy, entries))
    counts = count_ops(prefill)
    layers = getattr(engine, "num_layers", None)
    fields.update(
        aten_ops=counts.total,
        aten_ops_per_layer=counts.total / layers if layers else None,
        syncs=counts.syncs,
        h2d_copies=counts.h2d_copies,
    )
    if _on_cuda(engine):
        prof = profile_gpu(prefill, top_ops if policy != "full" else 0)
        fields.update(
            gpu_busy_ms=prof.busy_ms, gpu_busy_share=prof.busy_share, kernels=prof.kernels
        )
        if prof.table:
            syncs = ", ".join(f"{op} x{n}" for op, n in counts.sync_ops.most_common())
            typer.echo(f"\ntop {top_ops} ops by device time: {label}\n{prof.table}")
            typer.echo(f"syncs: {syncs or 'none'}; host-to-device copies: {counts.h2d_copies}")
    elif top_ops > 0:
        lines = [f"{n:>8}  {op}" for op, n in counts.by_op.most_common(top_ops)]
        typer.echo(f"\ntop {top_ops} aten ops by count: {label} ({counts.total} ops)")
        typer.echo("\n".join(lines))
    return fields


def run_offline(
    engine: Engine,
    image_counts: list[int],
    policies: list[str],
    repeats: int,
    top_ops: int = 0,
) -> list[dict]:
    """The benchmark's result rows (see the module docstring) over any `Engine`; top_ops: see
    `op_fields`."""
    from rich.progress import track

    from mpic.benchmarks.offline.engines import Driver
    from mpic.kernels.compiled import compile_stats

    drive = Driver(engine)
    try:
        # 336x336 images: 144 tokens each on the small LLaVA and Qwen2-VL (Qwen: native size).
        ids = [drive.add_image(synthetic_png(i, size=336)) for i in range(max(image_counts))]
        order = ["full"] + [p for p in policies if p != "full"]
        warmups = 2 if _on_cuda(engine) else 1  # CUDA: compilation and autotuning settle
        rows = []
        for n in track(image_counts, description="image counts"):
            parts = interleaved_prompt(ids[:n])
            ref: tuple[torch.Tensor, list[int]] | None = None
            for policy in order:
                falls = compile_stats()["eager_falls"]
                for _ in range(warmups):
                    drive.first_token(parts, policy)
                runs = [drive.first_token(parts, policy) for _ in range(repeats)]
                logits, scored = drive.scored(parts, policy)
                tokens = drive.greedy(parts, policy, GREEDY_TOKENS)
                if policy == "full":
                    ref = (logits, tokens)
                if policy not in policies:
                    continue
                label = f"{policy}, {n} images"
                ops = op_fields(engine, parts, policy, top_ops, label, drive.entries)
                assert ref is not None, "full runs first"
                ref_logits, ref_tokens = ref
                agree = sum(a == b for a, b in zip(tokens, ref_tokens, strict=True))
                stats = compile_stats()
                rows.append(
                    {
                        "policy": policy,
                        "images": n,
                        "prompt_tokens": scored.prompt_tokens,
                        "recomputed_tokens": runs[0].recomputed_tokens,
                        "ttft_ms": statistics.median(r.ttft_s for r in runs) * 1000,
                        "kl_vs_full": kl_divergence(ref_logits, logits),
                        "token_agreement": agree / GREEDY_TOKENS,
                        "cpu_ms": _median_cpu_ms(runs),
                        **ops,
                        "eager_falls": stats["eager_falls"] - falls,
                        "compiled_graphs": stats["graphs"],
                    }
                )
    finally:
        drive.close()
    add_floors(engine, rows, repeats)
    return rows


def _num(value: float | None, fmt: str = "{}") -> str:
    """`fmt` of value, or '-' for None."""
    return "-" if value is None else fmt.format(value)


def print_table(rows: list[dict]) -> None:
    """The results as a rich table on stdout, with ratios to `full` (wall and CPU time, aten
    ops). GPU busy %, kernels, syncs and eager falls appear only when some row has them (eager
    falls: when a compiled function ran or fell back in this process)."""
    from rich.console import Console
    from rich.table import Table

    full = {r["images"]: r for r in rows if r["policy"] == "full"}

    def has(key: str) -> bool:
        return any(r.get(key) is not None for r in rows)

    cols: list[tuple[str, Callable[[dict, dict | None], str]]] = [
        ("images", lambda r, ref: str(r["images"])),
        ("policy", lambda r, ref: r["policy"]),
        ("prompt", lambda r, ref: str(r["prompt_tokens"])),
        ("recomp.", lambda r, ref: str(r["recomputed_tokens"])),
        ("TTFT ms", lambda r, ref: f"{r['ttft_ms']:.1f}"),
        ("vs full", lambda r, ref: _ratio(r, ref, "ttft_ms")),
        ("CPU ms", lambda r, ref: _num(r.get("cpu_ms"), "{:.1f}")),
        ("vs full", lambda r, ref: _ratio(r, ref, "cpu_ms")),
        ("floor ms", lambda r, ref: _num(r.get("floor_ms"), "{:.1f}")),
        ("vs floor", lambda r, ref: _num(r.get("floor_ratio"), "{:.2f}x")),
        ("KL", lambda r, ref: f"{r['kl_vs_full']:.2e}"),
        ("agree", lambda r, ref: f"{r['token_agreement']:.2f}"),
        ("ops/layer", lambda r, ref: _num(r.get("aten_ops_per_layer"), "{:.0f}")),
        ("ops vs full", lambda r, ref: _ratio(r, ref, "aten_ops")),
    ]
    if has("gpu_busy_share"):
        cols.append(("GPU busy %", lambda r, ref: _num(r.get("gpu_busy_share"), "{:.0%}")))
        cols.append(("kernels", lambda r, ref: _num(r.get("kernels"))))
    if has("syncs"):
        cols.append(("syncs", lambda r, ref: _num(r.get("syncs"))))
    if any(r.get("eager_falls") or r.get("compiled_graphs") for r in rows):
        cols.append(("eager falls", lambda r, ref: _num(r.get("eager_falls"))))
    table = Table(title="MPIC offline benchmark")
    for col, _ in cols:
        table.add_column(col, justify="right", no_wrap=col == "policy")
    for r in rows:
        ref = full.get(r["images"])
        table.add_row(*(cell(r, ref) for _, cell in cols))
    Console(width=max(120, Console().width)).print(table)


def _ratio(row: dict, ref: dict | None, key: str) -> str:
    """row[key] / ref[key] as '0.42x', or '-'."""
    if ref is None or row.get(key) is None or not ref.get(key):
        return "-"
    return f"{row[key] / ref[key]:.2f}x"


def plot(rows: list[dict], path: str) -> None:
    """PNG: TTFT, CPU time, KL to full and aten ops per prefill against the image count, one
    line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_c, ax_k, ax_o) = plt.subplots(1, 4, figsize=(20, 4))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mine = [r for r in rows if r["policy"] == policy]
        xs = [r["images"] for r in mine]
        ax_t.plot(xs, [r["ttft_ms"] for r in mine], marker="o", label=policy)
        if all(r.get("cpu_ms") is not None for r in mine):
            ax_c.plot(xs, [r["cpu_ms"] for r in mine], marker="o", label=policy)
        ax_k.plot(xs, [max(r["kl_vs_full"], KL_FLOOR) for r in mine], marker="o", label=policy)
        if all(r.get("aten_ops") is not None for r in mine):
            ax_o.plot(xs, [r["aten_ops"] for r in mine], marker="o", label=policy)
    ax_t.set(xlabel="images", ylabel="median TTFT (ms)", title="Time to first token (wall)")
    ax_c.set(xlabel="images", ylabel="median CPU time (ms)", title="Prefill CPU time")
    ax_k.set(
        xlabel="images",
        ylabel="KL(full || policy), nats",
        yscale="log",
        title=f"First-token KL (0 drawn at {KL_FLOOR:g})",
    )
    ax_o.set(xlabel="images", ylabel="aten ops per prefill", title="Dispatched aten ops")
    ax_t.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def command(
    model: str = typer.Option(..., "--model", help="HF model folder."),
    engine: str = typer.Option("reference", "--engine", help="Engine name (reference, ...)."),
    images: str = typer.Option("1,2,4,8", "--images", help="Image counts, comma-separated."),
    policies: str = typer.Option(
        "full,prefix,full-reuse,cacheblend-15,mpic-32,vlcache-0.1",
        "--policies",
        help="Policy names, comma-separated (see docs/linker.md).",
    ),
    repeats: int = typer.Option(3, "--repeats", min=1, help="Timed runs per point (median)."),
    json_out: str = typer.Option(None, "--json", help="Write the results JSON here."),
    plot_out: str = typer.Option(None, "--plot", help="Write the PNG plot here."),
    device: str = typer.Option("cpu", "--device", help="reference engine: cpu | cuda"),
    dtype: str = typer.Option(
        "float32", "--dtype", help="reference engine: float32 | bfloat16 | float16"
    ),
    attention: str = typer.Option(
        None,
        "--attention",
        help="reference engine's attention backend: sdpa_runs | flex (default: flex on CUDA, "
        "sdpa_runs on CPU; see docs/kernels.md).",
    ),
    threads: int = typer.Option(
        1,
        "--threads",
        min=0,
        help="torch intra-op threads (0: torch's default). 1 is what vLLM "
        "binds on 2 cores, and keeps timings stable on a shared host (no spinning workers).",
    ),
    top_ops: int = typer.Option(
        0,
        "--top-ops",
        min=0,
        help="Print the top N ops of each row's prefill: on CUDA the profiler's table by "
        "device time (rows other than full), on CPU the aten ops by count (0: none).",
    ),
) -> None:
    """Run the offline TTFT/fidelity benchmark."""
    import torch

    from mpic.benchmarks.offline.engines import get_engine
    from mpic.linker.policies import policy_names

    try:
        counts = [int(x) for x in images.split(",") if x.strip()]
        if not counts or min(counts) < 1:
            raise ValueError("--images needs positive counts")
        if not Path(model, "config.json").is_file():
            raise ValueError(f"--model {model!r} is not an HF model folder")
        from mpic.model_spec import ModelSpec

        # names, and their per-layer fields against the model's depth (its config alone)
        names = policy_names(policies, ModelSpec.from_pretrained(model).num_layers)
        bench = get_engine(engine, model, device, dtype, attention)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    torch.set_grad_enabled(False)
    if threads:
        torch.set_num_threads(threads)
    try:
        rows = run_offline(bench, counts, names, repeats, top_ops)
    finally:
        if (close := getattr(bench, "close", None)) is not None:
            close()  # vLLM's processes
    print_table(rows)
    if json_out:
        doc = {
            "engine": engine,
            "model": model,
            "device": device,
            "dtype": dtype,
            "attention": attention,
            "results": rows,
        }
        Path(json_out).write_text(json.dumps(doc, indent=2))
    if plot_out:
        plot(rows, plot_out)
