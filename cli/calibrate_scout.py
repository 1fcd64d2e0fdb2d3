"""`mpic model calibrate-scout` (CLI process): S, the linked-key correction's scale, per recompute
budget for one model (`mpic.linker.calibration.scout`; the policy is `scout-<b>`).

The proxy set: `--prompts` prompts of `--documents` standard-library passages each, taken AFTER
the ones `mpic bench fidelity` uses (so the benchmark's prompts stay held out), cached alone and
linked into the benchmark's prompt layout with questions 0.. of its templates. For every budget
and every S of `--grid`, the mean first-token KL of `scout-<b>:s<S>` against full recomputation;
then (unless `--one-scale`) the first half of the layers' S over the same grid with the second
half at that best S (`scout-<b>:s<S1>/<S2>`). The best per budget forms the table: rows
(budget, S) or (budget, S1, S2). `--write` saves it in the model's folder
(`mpic_scout_scales.json`), where the reference runner and the vLLM front end pick it up for
`scout-<b>` / `auto` names that do not spell S out; `--json` writes every KL measured.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer


def parse_values(text: str, name: str) -> list[float]:
    """`0.1,0.2` or `start:stop:step` (inclusive) -> floats; typer.BadParameter otherwise."""
    try:
        if ":" in text:
            start, stop, step = (float(x) for x in text.split(":"))
            count = int(round((stop - start) / step)) + 1
            return [round(start + i * step, 6) for i in range(count)]
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise typer.BadParameter(f"{name}: {exc}") from exc


def command(
    model: str = typer.Option(..., "--model", help="HF model folder (e.g. mpic model import)."),
    budgets: str = typer.Option("0,0.1,0.2,0.3", "--budgets", help="Budget fractions."),
    grid: str = typer.Option("0.6:1.0:0.05", "--grid", help="S values: a,b,c or start:stop:step."),
    documents: int = typer.Option(4, "--documents", help="Passages per proxy prompt."),
    prompts: int = typer.Option(3, "--prompts", help="Proxy prompts."),
    threads: int = typer.Option(None, "--threads", help="torch CPU threads."),
    one_scale: bool = typer.Option(
        False, "--one-scale", help="One S in every layer (no sweep of the first half's S)."
    ),
    write: bool = typer.Option(False, "--write", help="Save the table in the model folder."),
    json_out: str = typer.Option(None, "--json", help="Write every measured KL here."),
) -> None:
    """Calibrate scout's correction scale S per recompute budget on proxy prompts."""
    budget_list = parse_values(budgets, "--budgets")
    scales = parse_values(grid, "--grid")
    if not budget_list or any(not 0 <= b <= 1 for b in budget_list):
        typer.echo("error: --budgets takes fractions in [0, 1]", err=True)
        raise typer.Exit(code=2)
    if not scales or any(not 0 < s <= 2 for s in scales) or documents < 1 or prompts < 1:
        typer.echo("error: --grid takes S in (0, 2]; --documents, --prompts >= 1", err=True)
        raise typer.Exit(code=2)
    import torch

    from mpic.benchmarks.fidelity.prompts import passages, question_parts
    from mpic.benchmarks.offline.bench import kl_divergence
    from mpic.engine.hf.reference_runner import ReferenceRunner
    from mpic.linker.calibration.scout import calibrate_scale
    from mpic.linker.policies.scout import ScoutPolicy
    from mpic.linker.policies.scout_scales import TABLE_FILE

    if threads:
        torch.set_num_threads(threads)
    try:
        runner = ReferenceRunner(model)
        docs = passages(documents * prompts, skip=16)  # the benchmark uses the first 16
    except (FileNotFoundError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    proxies = []
    for p in range(prompts):
        chunk = docs[p * documents : (p + 1) * documents]
        ids = [runner.cache_document(d.text).entry_id for d in chunk]
        parts = question_parts(chunk, ids, p)
        proxies.append((parts, runner.prefill(parts, "full").logits))

    def kl_at(budget: float, early: float, late: float) -> float:
        policy = ScoutPolicy(budget, early, late_scale=late)
        kls = [kl_divergence(ref, runner.prefill(parts, policy).logits) for parts, ref in proxies]
        return sum(kls) / len(kls)

    sweeps = calibrate_scale(kl_at, budget_list, scales, per_half=not one_scale)
    table = [sw.row for sw in sweeps]
    for sw in sweeps:
        plain = sw.kl.get(1.0)
        spelled = "/".join(f"{s:g}" for s in sw.row[1:])
        typer.echo(
            f"budget {sw.budget:g}: S = {spelled} (KL {sw.best_kl:.4f}; one S {sw.best:g}: "
            f"{sw.kl[sw.best]:.4f}" + (f"; S = 1: {plain:.4f})" if plain is not None else ")")
        )
    if write:
        path = Path(model) / TABLE_FILE
        path.write_text(json.dumps({"table": table}, indent=1))
        typer.echo(f"wrote {path}")
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        data = {
            "table": table,
            "kl": [
                {"budget": sw.budget, "kl": sw.kl, "first_half_kl": sw.early_kl} for sw in sweeps
            ],
        }
        Path(json_out).write_text(json.dumps(data, indent=1))
