"""`mpic bench fidelity` (CLI process): how close each policy's answers come to exact recomputation
on a trained language model, with cached text documents as the items.

Passages are real prose that needs no download: the docstrings of standard-library modules,
collected at run time (`passages`), each cut at a paragraph boundary to ~`chars` characters. Every
passage is cached alone in its canonical context (system prompt + start of a user turn, the way an
uploaded file is), then n of them are linked into a new prompt after an introduction, with a short
header before each and a question about them at the end; so every document sits at another
position and after other text than when it was cached (the mismatch of MPIC section 3, and of
CacheBlend / EPIC for RAG).

Per (policy, n) the figures are means over the questions, each against `full` (every token
recomputed = the plain prefill) on the same prompt:
- `recomputed_fraction`: tokens recomputed (depth > 0, both steps of two-step policies) / prompt
  tokens;
- `kl_first`: KL(p_full || p_policy) of the first output token's distribution, nats;
- `agreement_32`: the share of the 32 greedy output positions holding the same token (an answer
  that ended counts as end-of-sequence from there on);
- `exact_prefix`: how many leading greedy tokens equal the exact answer's (at most 32);
- `rouge_l`: ROUGE-L F1 of the answer's words against the exact answer's (longest common
  subsequence, beta 1: Elastic Cache's metric, `rouge_l_f1`);
- `ttft_ms`: request to first token with the entries in memory (the engine's `Prefill.ttft_s`).

Every request goes through the `mpic.engine.protocol.Engine` protocol (`answers.Answers`: the
offline benchmark's `Driver`), to the reference engine (`mpic.engine.hf.engine.ReferenceEngine`);
what the protocol does not carry is read from its optional members (`Engine`'s docstring): the
scouting cost from `Prefill.scout`, VLCache's calibration from `layer_adapter`, the noise floors
from `variant`.

Writes a table, JSON `{"model", "results": [{"policy", "documents", "recomputed_fraction",
"kl_first", "agreement_32", "exact_prefix", "rouge_l", "ttft_ms", "prompt_tokens", ...}]}` and a
PNG of fidelity against recomputed fraction. `--task needle` adds task accuracy (a planted code
in one cached document: `task`), each policy's and its ratio to full's, as JSON `"task"`.
`--calibrate-vlcache R` first calibrates VLCache per layer (`mpic.linker.calibration.vlcache`)
on proxy prompts of OTHER passages and adds its schedule. `--noise-floor bf16,flex` adds a row
per floor after `full`'s: the same prompts (and trials) under full prefill computed another way
(bfloat16, the other attention backend) scored like a policy, and `kl_over_floor` on every
policy row. `--exact-decode` decodes each answer after its first token over the exact KV
(`answers.Answers.answer`; rows say `exact_decode`). docs/fidelity.md has measured results.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from mpic.benchmarks.fidelity.answers import Answers
from mpic.benchmarks.fidelity.prompts import (
    LAYOUTS,
    Passage,
    calibrate_vlcache_on_documents,
    image_parts,
    passages,
    question_parts,
)
from mpic.benchmarks.fidelity.report import ROW_KEYS, plot, policy_rows, print_table
from mpic.engine.answers import exact_prefix, rouge_l_f1, token_agreement
from mpic.linker.prompt import tokenizer_of

if TYPE_CHECKING:  # torch loads inside the command so `mpic --help` stays fast
    from rich.progress import Progress

    from mpic.benchmarks.fidelity.noise_floor import NoiseFloor
    from mpic.engine.protocol import Engine

__all__ = ["ROW_KEYS", "command", "run_fidelity"]  # ROW_KEYS: the JSON rows' keys (`report`)

logger = logging.getLogger(__name__)

GREEDY_TOKENS = 32
DEFAULT_POLICIES = (
    "full,full-reuse,cacheblend-15,vlcache-0.1,mpic-32,boundary-16,scout-0.1,scout-0.2,scout-0.3"
)
WEAK_ITEMS_KL = 0.05
"""Below this KL(full || no items) the items barely change the answer: a warning is printed."""


def run_fidelity(
    engine: Engine,
    document_counts: list[int],
    policies: list[str],
    questions: int,
    chars: int = 700,
    progress: Progress | None = None,
    layout: str = "user",
    items: str = "documents",
    first_question: int = 0,
    floors: Sequence[NoiseFloor] = (),
    exact_decode: bool = False,
) -> list[dict[str, Any]]:
    """The result rows (one per policy and item count, means over questions `first_question`,
    ..., `first_question + questions - 1`); each generation is counted on `progress` when given.
    engine: the `Engine` answering (a bare reference runner is wrapped, `answers.engine_of`).
    exact_decode: every policy's greedy answer decodes its tokens after the first over the
    prompt's exact KV (`mpic.benchmarks.fidelity.answers.Answers.answer`); KL is the policy's.

    items: "documents" (standard-library passages; `layout` from `LAYOUTS`) or "images"
    (synthetic pictures; one user turn). Besides each policy's KL, every prompt's exact answer is
    compared with the exact answer to the same prompt without its items: `kl_no_items`, and
    `effect_kept` = 1 - mean KL(full || policy) / mean KL(full || no items).

    floors (`noise_floor.make_floor`): each adds a row right after `full`'s, its
    `policy` the floor's label and `noise_floor` its name (None on policy rows): the same prompts
    under full prefill computed the floor's way, scored against the reference's `full` like a
    policy. Every row's `kl_over_floor` is its KL over the first floor's (None without a floor,
    on floor rows, or where that floor's KL is 0).
    """
    from mpic.benchmarks.offline.bench import kl_divergence
    from mpic.prompt_parts import without_items

    answers = Answers(engine)
    try:
        count = max(document_counts)
        if items == "images":
            from mpic.samples import synthetic_png

            media = [synthetic_png(i, size=336) for i in range(count)]
            ids = [answers.add_image(m) for m in media]
            for floor in floors:
                for entry_id, m in zip(ids, media, strict=True):
                    floor.add_image(entry_id, m)
            docs: list[Passage] = []
        else:
            docs = passages(count, chars)
            ids = [answers.add_document(d.text) for d in docs]
            for floor in floors:
                for entry_id, d in zip(ids, docs, strict=True):
                    floor.add_document(entry_id, d.text)
        eos = answers.engine.spec.eos_token_id
        tok = tokenizer_of(answers.engine.processor)
        by_label = {f.label: f for f in floors}
        order = ["full", *by_label] + [p for p in policies if p != "full"]
        total = len(document_counts) * questions * len(order)
        task = progress.add_task("generations", total=total) if progress is not None else None
        rows = []
        for n in document_counts:
            per_policy: dict[str, list[dict[str, float]]] = {p: [] for p in order}
            no_items: list[float] = []
            prompt_tokens = 0
            for q in range(first_question, first_question + questions):
                if items == "images":
                    parts = image_parts(ids[:n], q)
                else:
                    parts = question_parts(docs[:n], ids[:n], q, layout)
                answers.answer(parts, "full", 1)  # warm-up (allocator, first-call costs)
                if q == first_question:
                    for floor in floors:
                        floor.answer(parts, 1)  # its warm-up
                ref = None
                for policy in order:
                    floor = by_label.get(policy)
                    if floor is None:
                        gen = answers.answer(parts, policy, GREEDY_TOKENS, exact_decode)
                    else:
                        gen = floor.answer(parts, GREEDY_TOKENS)
                    pre = gen.prefill
                    text = tok.decode(gen.tokens, skip_special_tokens=True)
                    if ref is None:
                        ref = (gen.logits, gen.tokens, text)
                        prompt_tokens = pre.prompt_tokens
                        bare = answers.answer(without_items(parts), "full", 1)
                        no_items.append(kl_divergence(gen.logits, bare.logits))
                    scout = pre.scout
                    per_policy[policy].append(
                        {
                            "recomputed_fraction": gen.recomputed_fraction,
                            "kl_first": kl_divergence(ref[0], gen.logits),
                            "agreement_32": token_agreement(gen.tokens, ref[1], GREEDY_TOKENS, eos),
                            "exact_prefix": exact_prefix(gen.tokens, ref[1], GREEDY_TOKENS, eos),
                            "rouge_l": rouge_l_f1(text, ref[2]),
                            "ttft_ms": pre.ttft_s * 1000,
                            "scout_layers": scout.layers_run if scout else 0,
                            "scout_tokens": scout.tokens if scout else 0,
                        }
                    )
                    logger.info("n=%d q=%d %s: %r", n, q, policy, text)
                    if progress is not None:
                        progress.advance(task)
            kl_items = statistics.fmean(no_items)
            if kl_items < WEAK_ITEMS_KL:
                logger.warning(
                    "%d %s (%s): the items barely change the exact answer (KL %.4f without them): "
                    "these prompts measure nothing",
                    n,
                    items,
                    layout,
                    kl_items,
                )
            rows += policy_rows(
                per_policy,
                no_items,
                documents=n,
                layout=layout if items == "documents" else "images",
                prompt_tokens=prompt_tokens,
                floors={f.label: f.name for f in floors},
                exact_decode=exact_decode,
            )
        return rows
    finally:
        answers.close()


def command(
    model: str = typer.Option(..., "--model", help="HF model folder (e.g. mpic model import)."),
    documents: str = typer.Option("4,8", "--documents", help="Documents per prompt, 2-16."),
    policies: str = typer.Option(DEFAULT_POLICIES, "--policies", help="Comma-separated."),
    questions: int = typer.Option(4, "--questions", help="Questions per document count."),
    chars: int = typer.Option(700, "--chars", help="Characters per passage (about 4 per token)."),
    calibrate_vlcache: float = typer.Option(
        None, "--calibrate-vlcache", help="Also calibrate VLCache to this r_bar and include it."
    ),
    calibration_grid: str = typer.Option(
        "0.05:0.3:0.05", "--calibration-grid", help="Ratio grid of the calibration."
    ),
    layouts: str = typer.Option(
        "user", "--layouts", help=f"Prompt layouts, comma-separated: {', '.join(LAYOUTS)}."
    ),
    items: str = typer.Option("documents", "--items", help="documents or images (LLaVA)."),
    first_question: int = typer.Option(
        0, "--first-question", help="Index of the first question (held-out sets start later)."
    ),
    decode_correction: bool = typer.Option(
        False,
        "--decode-correction/--no-decode-correction",
        help="Keep scout's linked-key correction while decoding (both engines decode plainly "
        "by default).",
    ),
    link_prefix: bool = typer.Option(
        True,
        "--link-prefix/--no-link-prefix",
        help="Link the template/system prefix shared with the entries' context from a prefix "
        "cache (not recomputed; every policy but full and prefix; the engines' default).",
    ),
    task: str = typer.Option(
        "none",
        "--task",
        help="Also score task accuracy: needle (a planted secret code in one cached document; "
        "accuracy and its ratio to full per policy), or none.",
    ),
    trials: int = typer.Option(12, "--trials", help="Task trials per document count."),
    task_seed: int = typer.Option(
        0,
        "--task-seed",
        help="Seed of the task's planted codes (another seed: other trials, e.g. held out from "
        "the ones a selection was chosen on).",
    ),
    noise_floor: str = typer.Option(
        "none",
        "--noise-floor",
        help="Also measure the noise floor of every metric: the same prompts under full prefill "
        "computed another way, scored against full like a policy (a row each; comma-separated): "
        "bf16 or fp16 (the model in that dtype), flex or sdpa_runs (the other attention "
        "backend), or none.",
    ),
    exact_decode: bool = typer.Option(
        False,
        "--exact-decode/--no-exact-decode",
        help="Decode each answer after its first token over the exact KV (mpic.exact_decode).",
    ),
    threads: int = typer.Option(None, "--threads", help="torch CPU threads (default: torch's)."),
    json_out: str = typer.Option(None, "--json", help="Write the JSON results here."),
    plot_out: str = typer.Option(None, "--plot", help="Write the PNG plot here."),
) -> None:
    """Answer fidelity per policy on a trained model with cached text documents."""
    from mpic.benchmarks.fidelity.noise_floor import make_floor, parse_floors
    from mpic.linker.policies import policy_names

    try:
        counts = [int(x) for x in documents.split(",") if x.strip()]
        names = policy_names(policies)
        floor_names = parse_floors(noise_floor)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    if not counts or any(not 2 <= n <= 16 for n in counts):
        typer.echo("error: --documents takes counts between 2 and 16", err=True)
        raise typer.Exit(code=2)
    chosen_layouts = [x.strip() for x in layouts.split(",") if x.strip()]
    if not chosen_layouts or any(x not in LAYOUTS for x in chosen_layouts):
        typer.echo(f"error: --layouts takes {', '.join(LAYOUTS)}", err=True)
        raise typer.Exit(code=2)
    if items not in ("documents", "images") or first_question < 0:
        typer.echo("error: --items takes documents or images; --first-question >= 0", err=True)
        raise typer.Exit(code=2)
    if task not in ("none", "needle") or trials < 1:
        typer.echo("error: --task takes needle or none; --trials must be >= 1", err=True)
        raise typer.Exit(code=2)
    if questions < 1 or chars < 100:
        typer.echo("error: --questions must be >= 1 and --chars >= 100", err=True)
        raise typer.Exit(code=2)
    if calibrate_vlcache is not None and not 0 < calibrate_vlcache <= 0.3:
        typer.echo("error: --calibrate-vlcache takes r_bar in (0, 0.3]", err=True)
        raise typer.Exit(code=2)
    import torch

    from mpic.engine.hf.engine import ReferenceEngine

    if threads:
        torch.set_num_threads(threads)
    try:
        engine = ReferenceEngine.load(
            model, decode_correction=decode_correction, link_prefix=link_prefix
        )
        floors = [make_floor(engine, model, name) for name in floor_names]
        policy_names(policies, engine.spec.num_layers)  # per-layer fields against the depth
    except (FileNotFoundError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    from rich.progress import Progress

    with Progress() as progress:
        if calibrate_vlcache is not None:
            name = calibrate_vlcache_on_documents(
                engine, calibrate_vlcache, calibration_grid, 4, 2, progress=progress
            )
            progress.console.print(
                f"calibrated VLCache schedule (r_bar {calibrate_vlcache:g}): {name}"
            )
            names.append(name)
        rows = []
        for layout in chosen_layouts if items == "documents" else ["user"]:
            rows += run_fidelity(
                engine,
                counts,
                names,
                questions,
                chars,
                progress=progress,
                layout=layout,
                items=items,
                first_question=first_question,
                floors=floors,
                exact_decode=exact_decode,
            )
        task_rows = None
        if task == "needle":
            from mpic.benchmarks.fidelity.task import run_task

            docs = passages(max(counts), chars)
            task_rows = run_task(
                engine,
                docs,
                counts,
                names,
                trials,
                progress=progress,
                seed=task_seed,
                floors=floors,
                exact_decode=exact_decode,
            )
    for floor in floors:
        floor.close()
    print_table(rows, model)
    doc: dict[str, Any] = {"model": str(Path(model).resolve()), "results": rows}
    if task_rows is not None:
        from mpic.benchmarks.fidelity.task import print_task_table

        print_task_table(task_rows)
        doc["task"] = {"name": task, "results": task_rows}
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps(doc, indent=1))
    if plot_out:
        Path(plot_out).parent.mkdir(parents=True, exist_ok=True)
        plot(rows, plot_out)
    if not math.isfinite(sum(r["kl_first"] for r in rows)):
        typer.echo("warning: a KL is not finite", err=True)
    for r in rows:
        if r["policy"] == "full" and r["kl_no_items"] < WEAK_ITEMS_KL:
            typer.echo(
                f"warning: {r['layout']}, {r['documents']} items: the items barely change the "
                f"exact answer (KL {r['kl_no_items']:.4f} without them); this measures nothing",
                err=True,
            )
