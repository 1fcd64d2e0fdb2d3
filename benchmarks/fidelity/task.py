"""`mpic bench fidelity --task needle` (CLI process): does the model still get the answer right
under a policy? Task accuracy on the cached documents, beside the fidelity figures.

The task is built offline from the same standard-library passages (`prompts.passages`), so it needs
no download: in every trial ONE document carries a planted fact, "The secret code is NNNN." (a fresh
four-digit code), at a depth inside that document (its start, its middle paragraph boundary, or its
end), and that document sits at another position among n (trial t plants in document t mod n, depths
cycle). The planted document is cached like any upload; the others are the plain passages. The
question: "What is the secret code? Answer with the number only." An answer is right when its first
12 greedy tokens contain the code (exact match of the four digits).

The prompt without the documents cannot know the code (a check of the items' effect: its
accuracy is reported as `no_items`). Accuracy is reported per policy and document count with
its ratio to full prefill's on the same trials (ProphetKV and InfoFlow KV report task accuracy
relative to full at a fixed recompute budget), beside the first-token KL against full on the
same prompts and the recomputed fraction. Chosen because the trained SmolLM2-135M answers it
(full prefill 100% at 4 documents, 88% at 8 in a first try) where it cannot name which document
holds which code (a per-document code asked by document name: 12%). With noise floors
(`noise_floor`) the same trials also run under full prefill computed another way
(e.g. in bfloat16): a row each, so an accuracy gap reads against full's own numerical noise.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mpic.benchmarks.fidelity.answers import Answers
from mpic.linker.prompt import tokenizer_of

if TYPE_CHECKING:
    from rich.progress import Progress

    from mpic.benchmarks.fidelity.noise_floor import NoiseFloor
    from mpic.engine.protocol import Engine
    from mpic.prompt_parts import PromptPart

ANSWER_TOKENS = 12
DEPTHS = ("end", "start", "middle")
QUESTION = "\n\nQuestion: What is the secret code? Answer with the number only."


def plant(text: str, code: int, depth: str) -> str:
    """`text` with "The secret code is `code`." at `depth` (`DEPTHS`): before it, after it, or
    at the paragraph boundary nearest its middle (its end when it has one paragraph)."""
    fact = f"The secret code is {code}."
    if depth == "start":
        return f"{fact}\n\n{text}"
    if depth == "middle":
        breaks = [i for i in range(len(text)) if text.startswith("\n\n", i)]
        if breaks:
            cut = min(breaks, key=lambda i: abs(i - len(text) // 2))
            return f"{text[:cut]}\n\n{fact}{text[cut:]}"
    if depth in ("middle", "end"):
        return f"{text}\n\n{fact}"
    raise ValueError(f"unknown depth {depth!r}; valid: {', '.join(DEPTHS)}")


def needle_parts(names: list[str], entry_ids: list[str]) -> list[PromptPart]:
    """An introduction, "Document i (module):" before each cached document, the question."""
    from mpic.prompt_parts import DocumentRef

    parts: list[PromptPart] = ["Read the following documents, then answer the question."]
    for i, (name, entry_id) in enumerate(zip(names, entry_ids, strict=True), start=1):
        parts += [f"\n\nDocument {i} ({name}):\n", DocumentRef(entry_id)]
    return [*parts, QUESTION]


def run_task(
    engine: Engine,
    docs: Sequence[Any],
    document_counts: list[int],
    policies: list[str],
    trials: int,
    progress: Progress | None = None,
    seed: int = 0,
    floors: Sequence[NoiseFloor] = (),
    exact_decode: bool = False,
) -> list[dict[str, Any]]:
    """One row per policy and document count: `accuracy` (share of `trials` answered right),
    `accuracy_vs_full`, `no_items` (the prompt without its documents), `kl_first` (mean, vs
    full), `recomputed_fraction` (mean), `noise_floor` (None). engine: the `Engine` answering
    (a bare reference runner is wrapped, `answers.engine_of`). docs: at least
    max(document_counts) passages with `name` and `text` (`prompts.passages`).
    floors (`noise_floor`): a row each after full's, the same trials under full
    prefill computed the floor's way (`policy` its label, `noise_floor` its name). exact_decode:
    answers decoded after their first token over the exact KV (`answers.Answers.answer`)."""
    from mpic.benchmarks.offline.bench import kl_divergence
    from mpic.prompt_parts import without_items

    answers = Answers(engine)
    try:
        plain = [answers.add_document(d.text) for d in docs]
        for floor in floors:
            for entry_id, d in zip(plain, docs, strict=True):
                floor.add_document(entry_id, d.text)
        tok = tokenizer_of(answers.engine.processor)
        by_label = {f.label: f for f in floors}
        order = ["full", *by_label] + [p for p in policies if p != "full"]
        total = len(document_counts) * trials * (len(order) + 1)
        job = progress.add_task("task trials", total=total) if progress is not None else None
        rng = random.Random(seed)
        rows = []
        for n in document_counts:
            right = {p: 0 for p in [*order, "no_items"]}
            kl: dict[str, list[float]] = {p: [] for p in order}
            share: dict[str, list[float]] = {p: [] for p in order}
            for t in range(trials):
                code, target = rng.randint(1000, 9999), t % n
                ids = plain[:n]
                planted = plant(docs[target].text, code, DEPTHS[(t // n) % len(DEPTHS)])
                ids[target] = answers.add_document(planted)
                for floor in floors:
                    floor.add_document(ids[target], planted)
                parts = needle_parts([d.name for d in docs[:n]], ids)
                ref = None
                for policy in [*order, "no_items"]:
                    asked = without_items(parts) if policy == "no_items" else parts
                    floor = by_label.get(policy)
                    if floor is not None:
                        gen = floor.answer(parts, ANSWER_TOKENS)
                    else:
                        gen = answers.answer(
                            asked,
                            "full" if policy == "no_items" else policy,
                            ANSWER_TOKENS,
                            exact_decode,
                        )
                    right[policy] += str(code) in tok.decode(gen.tokens, skip_special_tokens=True)
                    if policy != "no_items":
                        ref = gen.logits if ref is None else ref
                        kl[policy].append(kl_divergence(ref, gen.logits))
                        share[policy].append(gen.recomputed_fraction)
                    if progress is not None:
                        progress.advance(job)
            full = right["full"] / trials
            for policy in order:
                accuracy = right[policy] / trials
                rows.append(
                    {
                        "policy": policy,
                        "documents": n,
                        "trials": trials,
                        "accuracy": accuracy,
                        "accuracy_vs_full": accuracy / full if full else None,
                        "no_items": right["no_items"] / trials,
                        "kl_first": statistics.fmean(kl[policy]),
                        "recomputed_fraction": statistics.fmean(share[policy]),
                        "noise_floor": by_label[policy].name if policy in by_label else None,
                        "exact_decode": exact_decode,
                    }
                )
        return rows
    finally:
        answers.close()


def print_task_table(rows: list[dict[str, Any]]) -> None:
    """The task rows as a rich table on stdout."""
    from rich.console import Console
    from rich.table import Table

    from mpic.benchmarks.fidelity.noise_floor import kl_text

    table = Table(title="Task: the planted secret code (needle in the cached documents)")
    for col in ("docs", "policy", "recomputed", "accuracy", "vs full", "no docs", "KL first"):
        table.add_column(col, justify="right", no_wrap=col == "policy")
    for r in rows:
        vs = "-" if r["accuracy_vs_full"] is None else f"{r['accuracy_vs_full']:.0%}"
        table.add_row(
            str(r["documents"]),
            r["policy"],
            f"{r['recomputed_fraction']:.1%}",
            f"{r['accuracy']:.0%} of {r['trials']}",
            vs,
            f"{r['no_items']:.0%}",
            kl_text(r["kl_first"]),
        )
    Console(width=max(100, Console().width)).print(table)
