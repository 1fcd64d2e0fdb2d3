"""`mpic model calibrate-scout` (CLI process): S, the linked-key correction's scale, per recompute
budget for one model (`mpic.linker.calibration.scout`; the policy is `scout-<b>`).

The proxy set: `--prompts` prompts (4) of `--documents` (8) standard-library passages each, AFTER
the ones `mpic bench fidelity` uses (so the benchmark's prompts stay held out), cached alone and
linked into the benchmark's prompt layout with questions 0.. of its templates. For every budget
and every S of `--grid`, the mean first-token KL of `scout-<b>:s<S>` against full recomputation;
then (unless `--one-scale`) the first half of the layers' S over the same grid with the second
half at that best S (`scout-<b>:s<S1>/<S2>`). The best per budget forms the table: rows
(budget, S) or (budget, S1, S2). `--write` saves it in the model's folder
(`mpic_scout_scales.json`), where the reference runner and the vLLM front end pick it up for
`scout-<b>` / `auto` names that do not spell S out; `--json` writes every KL measured.

Before S, the scout's own fields (`--scout-layers`, `--question-weights`): every scoring-layer
span with every question weight, at the default S, by the mean KL over the budgets strictly
between 0 and 1 (`mpic.linker.calibration.scout.choose_scout`; the default span and weight 0 win
ties). When another pair wins, S is swept with it and the table carries it (`"scout": {"layers",
"question_weight"}`): `auto` and `scout-<b>` names that do not spell `:l` / `:w` then score those
layers with that weight, on both engines (the names the front end resolves spell them).
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


def parse_spans(text: str) -> list[tuple[int, ...]] | str:
    """`--scout-layers`: "auto", "none" (no spans: []), or spans `a-b[_c-d]` joined by commas;
    typer.BadParameter otherwise."""
    from mpic.linker.policies.scout import parse_layers

    text = text.strip()
    if text in ("auto", "none"):
        return "auto" if text == "auto" else []
    try:
        return [tuple(parse_layers(span.strip())) for span in text.split(",") if span.strip()]
    except ValueError as exc:
        raise typer.BadParameter(f"--scout-layers: {exc}") from exc


def command(
    model: str = typer.Option(..., "--model", help="HF model folder (e.g. mpic model import)."),
    budgets: str = typer.Option("0,0.1,0.2,0.3", "--budgets", help="Budget fractions."),
    grid: str = typer.Option("0.6:1.0:0.05", "--grid", help="S values: a,b,c or start:stop:step."),
    documents: int = typer.Option(8, "--documents", help="Passages per proxy prompt."),
    prompts: int = typer.Option(4, "--prompts", help="Proxy prompts."),
    threads: int = typer.Option(None, "--threads", help="torch CPU threads."),
    one_scale: bool = typer.Option(
        False, "--one-scale", help="One S in every layer (no sweep of the first half's S)."
    ),
    scout_layers: str = typer.Option(
        "auto",
        "--scout-layers",
        help="Scoring-layer spans to try first: auto (2-5, 1-8, 2-8, 2-12 of 30, at the model's "
        "depth), none (keep the default), or spans a-b[_c-d],...",
    ),
    question_weights: str = typer.Option(
        "0,0.5", "--question-weights", help="Question weights to try with each span."
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
    weights = parse_values(question_weights, "--question-weights")
    if not weights or any(not 0 <= w <= 100 for w in weights):
        typer.echo("error: --question-weights takes weights in [0, 100]", err=True)
        raise typer.Exit(code=2)
    asked = parse_spans(scout_layers)
    import torch

    from mpic.benchmarks.fidelity.prompts import passages, question_parts
    from mpic.benchmarks.offline.bench import kl_divergence
    from mpic.engine.hf.reference_runner import ReferenceRunner
    from mpic.linker.calibration.scout import calibrate_scale, candidate_spans, choose_scout
    from mpic.linker.policies.scout import ScoutPolicy, spell_layers
    from mpic.linker.policies.scout import scout_layers as default_layers
    from mpic.linker.policies.scout_scales import TABLE_FILE, ScoutTable

    if threads:
        torch.set_num_threads(threads)
    try:
        runner = ReferenceRunner(model)
        docs = passages(documents * prompts, skip=16)  # the benchmark uses the first 16
    except (FileNotFoundError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    depth = runner.adapter.num_layers
    spans = candidate_spans(depth) if asked == "auto" else list(asked)
    if spans and max(max(span) for span in spans) >= depth:
        typer.echo(
            f"error: --scout-layers past the model's {depth} layers (0-{depth - 1})", err=True
        )
        raise typer.Exit(code=2)
    proxies = []
    for p in range(prompts):
        chunk = docs[p * documents : (p + 1) * documents]
        ids = [runner.cache_document(d.text).entry_id for d in chunk]
        parts = question_parts(chunk, ids, p)
        proxies.append((parts, runner.prefill(parts, "full").logits))

    def mean_kl(policy: ScoutPolicy) -> float:
        kls = [kl_divergence(ref, runner.prefill(parts, policy).logits) for parts, ref in proxies]
        return sum(kls) / len(kls)

    layers, weight, choice = None, None, None
    inner = [b for b in budget_list if 0 < b < 1]  # where the scores choose tokens
    if spans and inner:
        default = tuple(default_layers(depth))
        spans = [default, *(span for span in spans if span != default)]
        choice = choose_scout(
            lambda b, span, w: mean_kl(ScoutPolicy(b, layers=span, question_weight=w)),
            inner,
            spans,
            [0.0, *(w for w in weights if w != 0.0)],
        )
        if not choice.is_default:
            layers, weight = choice.layers, choice.question_weight
        chosen = (choice.layers, choice.question_weight)
        typer.echo(
            f"scout: layers {spell_layers(chosen[0])}, question weight {chosen[1]:g} "
            f"(mean KL {choice.kl[chosen]:.4f}; the default, "
            f"layers {spell_layers(default)} and weight 0: {choice.kl[(default, 0.0)]:.4f})"
        )

    def kl_at(budget: float, early: float, late: float) -> float:
        return mean_kl(
            ScoutPolicy(budget, early, late_scale=late, layers=layers, question_weight=weight)
        )

    sweeps = calibrate_scale(kl_at, budget_list, scales, per_half=not one_scale)
    table = ScoutTable(tuple(sw.row for sw in sweeps), layers, weight)
    for sw in sweeps:
        plain = sw.kl.get(1.0)
        spelled = "/".join(f"{s:g}" for s in sw.row[1:])
        typer.echo(
            f"budget {sw.budget:g}: S = {spelled} (KL {sw.best_kl:.4f}; one S {sw.best:g}: "
            f"{sw.kl[sw.best]:.4f}" + (f"; S = 1: {plain:.4f})" if plain is not None else ")")
        )
    if write:
        path = Path(model) / TABLE_FILE
        path.write_text(json.dumps(table.to_json(), indent=1))
        from mpic.linker.policies import get_policy

        typer.echo(f"wrote {path}: `auto` now names {get_policy('auto', scales=table).name}")
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        data = {
            **table.to_json(),
            "scout_kl": [
                {"layers": list(span), "question_weight": w, "kl": kl}
                for (span, w), kl in (choice.kl.items() if choice else ())
            ],
            "kl": [
                {"budget": sw.budget, "kl": sw.kl, "first_half_kl": sw.early_kl} for sw in sweeps
            ],
        }
        Path(json_out).write_text(json.dumps(data, indent=1))
