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
- `ttft_ms`: request to first token with the entries in memory (the reference runner's clock).

Writes a table, JSON `{"model", "results": [{"policy", "documents", "recomputed_fraction",
"kl_first", "agreement_32", "exact_prefix", "rouge_l", "ttft_ms", "prompt_tokens"}]}` and a PNG of
fidelity against recomputed fraction. `--task needle` adds task accuracy (a planted secret code
in one cached document: `mpic.benchmarks.fidelity_task`), each policy's and its ratio to full's,
as JSON `"task"`. `--calibrate-vlcache R` first runs VLCache's per-layer
calibration (`mpic.linker.vlcache_calibration`) on proxy prompts built from OTHER passages and
adds the calibrated schedule to the policies. `--noise-floor bf16,flex` adds the noise floor of
every metric (`mpic.benchmarks.noise_floor`): a row per floor after `full`'s, the same prompts
(and task trials) under full prefill computed another way (the model in bfloat16, the other
attention backend) scored against `full` like a policy, and `kl_over_floor` on every policy row
(its KL over the first floor's: how far beyond numerical noise). docs/fidelity.md has measured
results.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from mpic.benchmarks.noise_floor import kl_text
from mpic.engine.answers import exact_prefix, token_agreement
from mpic.linker.prompt import tokenizer_of

if TYPE_CHECKING:  # torch loads inside the command so `mpic --help` stays fast
    from rich.progress import Progress

    from mpic.benchmarks.noise_floor import NoiseFloor
    from mpic.engine.hf.reference_runner import ReferenceRunner
    from mpic.prompt_parts import PromptPart

logger = logging.getLogger(__name__)

GREEDY_TOKENS = 32
KL_FLOOR = 1e-6
DEFAULT_POLICIES = (
    "full,full-reuse,cacheblend-15,vlcache-0.1,mpic-32,boundary-16,scout-0.1,scout-0.2,scout-0.3"
)
ROW_KEYS = (
    "policy",
    "documents",
    "recomputed_fraction",
    "kl_first",
    "agreement_32",
    "exact_prefix",
    "rouge_l",
    "ttft_ms",
    "kl_no_items",
    "effect_kept",
    "layout",
    "scout_layers",
    "scout_tokens",
    "noise_floor",
    "kl_over_floor",
)
"""The keys every JSON result row has (plus `prompt_tokens`)."""

WEAK_ITEMS_KL = 0.05
"""Below this KL(full || no items) the items barely change the answer: a warning is printed."""

_MODULES = (
    "json",
    "heapq",
    "difflib",
    "argparse",
    "csv",
    "copy",
    "configparser",
    "statistics",
    "collections",
    "fileinput",
    "hashlib",
    "itertools",
    "random",
    "sched",
    "shelve",
    "timeit",
    "uuid",
    "wave",
    "plistlib",
    "struct",
    "subprocess",
    "socketserver",
    "cmd",
    "tempfile",
    "unittest",
    "doctest",
    "inspect",
    "tokenize",
    "smtplib",
    "ftplib",
)
"""Standard-library modules whose docstrings are the passages, in this order (those with too
short a docstring are skipped)."""

_QUESTIONS = (
    "What is the {name} module for? Answer in one sentence.",
    "Summarize the document about the {name} module in two sentences.",
    "Which functions or classes does the {name} module provide, according to the documents?",
    "Explain to a beginner when they would use the {name} module.",
)


@dataclass(frozen=True)
class Passage:
    """One real text passage: the module it documents and the text."""

    name: str
    text: str


def passages(count: int, chars: int = 700, skip: int = 0) -> list[Passage]:
    """`count` standard-library docstrings (after skipping `skip` usable ones), each cut at a
    paragraph (else line) boundary to at most ~`chars` characters. ValueError if the running
    Python has fewer usable ones."""
    import importlib

    out: list[Passage] = []
    usable = 0
    for name in _MODULES:
        try:
            doc = inspect.getdoc(importlib.import_module(name)) or ""
        except ImportError:
            continue
        doc = doc.strip()
        if len(doc) < chars // 2:
            continue
        usable += 1
        if usable <= skip:
            continue
        out.append(Passage(name, _cut(doc, chars)))
        if len(out) == count:
            return out
    raise ValueError(f"only {len(out)} standard-library passages available, {count} needed")


def _cut(text: str, chars: int) -> str:
    """The text up to the last paragraph (or line) end within `chars` characters."""
    if len(text) <= chars:
        return text
    head = text[:chars]
    for sep in ("\n\n", "\n"):
        end = head.rfind(sep)
        if end >= chars // 2:
            return head[:end].rstrip()
    return head.rstrip()


LAYOUTS = ("user", "system", "two-turn")
"""Prompt layouts: the items and the question in one user turn; the items in the system turn and
the question in a user turn; a two-turn conversation whose second user turn links the same items
again (the first turn asks another question, the assistant's reply is a fixed sentence)."""

_INTRO = "Read the following documents from the Python standard library, then answer the question."
_REPLY = "I have read the documents."


def _item_block(docs: list[Passage], entry_ids: list[str]) -> list[PromptPart]:
    from mpic.prompt_parts import DocumentRef

    parts: list[PromptPart] = []
    for i, (doc, entry_id) in enumerate(zip(docs, entry_ids, strict=True), start=1):
        parts.append(f"\n\nDocument {i} ({doc.name}):\n")
        parts.append(DocumentRef(entry_id))
    return parts


def _question(docs: list[Passage], question: int) -> str:
    """Question q asks about document q mod n with template (q + q // n) mod 4, so the first
    max(n, 4) questions over n documents are distinct prompts (with 4 documents, questions
    4-7 are not questions 0-3 again)."""
    n = len(docs)
    target = docs[question % n]
    template = _QUESTIONS[(question + question // n) % len(_QUESTIONS)]
    return "Question: " + template.format(name=target.name)


def question_parts(
    docs: list[Passage], entry_ids: list[str], question: int, layout: str = "user"
) -> list[PromptPart]:
    """The prompt of question `question` over `docs` (cached as `entry_ids`) in `layout`
    (`LAYOUTS`): an introduction, "Document i (module):" before each document, the question
    last."""
    from mpic.prompt_parts import Turn

    block = _item_block(docs, entry_ids)
    if layout == "user":
        return [_INTRO, *block, "\n\n" + _question(docs, question)]
    if layout == "system":
        return [Turn("system"), _INTRO, *block, Turn("user"), _question(docs, question)]
    if layout == "two-turn":
        first = _question(docs, question + 1)
        again = "Here are the same documents again."
        return [
            _INTRO,
            *block,
            "\n\n" + first,
            Turn("assistant"),
            _REPLY,
            Turn("user"),
            again,
            *block,
            "\n\n" + _question(docs, question),
        ]
    raise ValueError(f"unknown layout {layout!r}; valid: {', '.join(LAYOUTS)}")


def image_parts(entry_ids: list[str], question: int) -> list[PromptPart]:
    """A prompt over cached images (LLaVA with the trained language model): the images between
    short text, then a question about one of them."""
    from mpic.prompt_parts import ImageRef

    parts: list[PromptPart] = ["Look at the following pictures."]
    for i, entry_id in enumerate(entry_ids, start=1):
        parts += [f"\nPicture {i}:\n", ImageRef(entry_id)]
    asks = (
        "Describe picture {i}.",
        "What colours are in picture {i}?",
        "Compare picture {i} with the others.",
        "What is shown in picture {i}? Answer briefly.",
    )
    i = question % len(entry_ids) + 1
    parts.append("\n" + asks[question % len(asks)].format(i=i))
    return parts


def rouge_l_f1(candidate: str, reference: str) -> float:
    """ROUGE-L F1 (beta 1) of two texts over lower-cased word tokens: LCS / len gives recall and
    precision (Lin 2004). 1.0 for two empty texts, 0.0 if exactly one is empty."""
    cand, ref = _words(candidate), _words(reference)
    if not cand or not ref:
        return float(not cand and not ref)
    lcs = _lcs_length(cand, ref)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(cand), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _lcs_length(a: list[str], b: list[str]) -> int:
    """Longest common subsequence length (O(len(a) * len(b)) dynamic programme, one row)."""
    row = [0] * (len(b) + 1)
    for x in a:
        prev = 0
        for j, y in enumerate(b, start=1):
            cur = row[j]
            row[j] = prev + 1 if x == y else max(row[j], row[j - 1])
            prev = cur
    return row[-1]


def run_fidelity(
    runner: ReferenceRunner,
    document_counts: list[int],
    policies: list[str],
    questions: int,
    chars: int = 700,
    progress: Progress | None = None,
    layout: str = "user",
    items: str = "documents",
    first_question: int = 0,
    floors: Sequence[NoiseFloor] = (),
) -> list[dict[str, Any]]:
    """The result rows (one per policy and item count, means over questions `first_question`,
    ..., `first_question + questions - 1`); each generation is counted on `progress` when given.

    items: "documents" (standard-library passages; `layout` from `LAYOUTS`) or "images"
    (synthetic pictures; one user turn). Besides each policy's KL, every prompt's exact answer is
    compared with the exact answer to the same prompt without its items: `kl_no_items`, and
    `effect_kept` = 1 - mean KL(full || policy) / mean KL(full || no items).

    floors (`mpic.benchmarks.noise_floor.make_floor`): each adds a row right after `full`'s, its
    `policy` the floor's label and `noise_floor` its name (None on policy rows): the same prompts
    under full prefill computed the floor's way, scored against the reference's `full` like a
    policy. Every row's `kl_over_floor` is its KL over the first floor's (None without a floor,
    on floor rows, or where that floor's KL is 0).
    """
    from mpic.benchmarks.offline import kl_divergence
    from mpic.prompt_parts import without_items

    count = max(document_counts)
    if items == "images":
        from mpic.samples import synthetic_png

        media = [synthetic_png(i, size=336) for i in range(count)]
        ids = [runner.cache_image(m).entry_id for m in media]
        for floor in floors:
            for entry_id, m in zip(ids, media, strict=True):
                floor.cache_image(entry_id, m)
        docs: list[Passage] = []
    else:
        docs = passages(count, chars)
        ids = [runner.cache_document(d.text).entry_id for d in docs]
        for floor in floors:
            for entry_id, d in zip(ids, docs, strict=True):
                floor.cache_document(entry_id, d.text)
    eos = runner.spec.eos_token_id
    tok = tokenizer_of(runner.processor)
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
            runner.prefill(parts, "full")  # warm-up (allocator, first-call costs)
            if q == first_question:
                for floor in floors:
                    floor.runner.prefill(floor.parts(parts), "full")  # its warm-up
            ref = None
            for policy in order:
                floor = by_label.get(policy)
                if floor is None:
                    gen = runner.generate(parts, policy, max_new_tokens=GREEDY_TOKENS)
                else:
                    gen = floor.runner.generate(
                        floor.parts(parts), "full", max_new_tokens=GREEDY_TOKENS
                    )
                pre = gen.prefilled
                text = tok.decode(gen.tokens, skip_special_tokens=True)
                if ref is None:
                    ref = (pre.logits, gen.tokens, text)
                    prompt_tokens = pre.plan.num_tokens
                    bare = runner.prefill(without_items(parts), "full")
                    no_items.append(kl_divergence(pre.logits, bare.logits))
                scout = pre.scout
                per_policy[policy].append(
                    {
                        "recomputed_fraction": pre.recomputed_tokens / pre.plan.num_tokens,
                        "kl_first": kl_divergence(ref[0], pre.logits),
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
        for policy in order:
            samples = per_policy[policy]
            row: dict[str, Any] = {"policy": policy, "documents": n}
            for key in ROW_KEYS[2:8]:
                row[key] = statistics.fmean(s[key] for s in samples)
            row["kl_no_items"] = kl_items
            row["effect_kept"] = 1.0 - row["kl_first"] / kl_items if kl_items > 0 else None
            row["layout"] = layout if items == "documents" else "images"
            row["scout_layers"] = max(s["scout_layers"] for s in samples)
            row["scout_tokens"] = statistics.fmean(s["scout_tokens"] for s in samples)
            row["prompt_tokens"] = prompt_tokens
            row["kl_per_question"] = [s["kl_first"] for s in samples]
            row["agreement_per_question"] = [s["agreement_32"] for s in samples]
            row["kl_no_items_per_question"] = list(no_items)
            floor = by_label.get(policy)
            row["noise_floor"] = None if floor is None else floor.name
            rows.append(row)
        group = rows[len(rows) - len(order) :]
        base = group[1]["kl_first"] if floors else 0.0  # the first floor's row follows full's
        for row in group:
            over = base > 0 and row["noise_floor"] is None
            row["kl_over_floor"] = row["kl_first"] / base if over else None
    return rows


def calibrate_vlcache_on_documents(
    runner: ReferenceRunner,
    target: float,
    grid: str,
    documents: int,
    prompts: int,
    chars: int = 700,
    progress: Progress | None = None,
) -> str:
    """VLCache's calibrated per-layer schedule for this model (the registry name), measured on
    `prompts` proxy prompts of `documents` passages disjoint from the benchmark's (VLCache
    section 4.1, `mpic.linker.vlcache_calibration.calibrate`); its prefill passes are counted
    on `progress` when given."""
    from mpic.linker.vlcache_calibration import (
        ProxyPrompt,
        calibrate,
        calibrate_with_progress,
        parse_grid,
    )

    # The benchmark uses the first passages; the proxy set takes the ones after its maximum (16).
    docs = passages(documents * prompts, chars, skip=16)
    proxies = []
    for p in range(prompts):
        chunk = docs[p * documents : (p + 1) * documents]
        ids = [runner.cache_document(d.text).entry_id for d in chunk]
        planned = runner.plan(question_parts(chunk, ids, p))
        proxies.append(ProxyPrompt(planned.plan, planned.entries))
    levels = parse_grid(grid)
    if progress is None:
        cal = calibrate(runner.adapter, proxies, target, levels)
    else:
        cal = calibrate_with_progress(runner.adapter, proxies, target, levels, progress)
    logger.info("calibrated %s: proxy %s", cal.policy, cal.proxy)
    return cal.policy


def over_text(ratio: float | None) -> str:
    """A KL as a multiple of the noise floor's ("-" where there is none)."""
    if ratio is None:
        return "-"
    return f"{ratio:.1f}x" if ratio < 10 else f"{ratio:,.0f}x"


def print_table(rows: list[dict[str, Any]], model: str) -> None:
    """The result table on stdout (with a `KL / floor` column when a noise floor was measured:
    each row's KL over the first floor's)."""
    from rich.console import Console
    from rich.table import Table

    floored = any(r.get("noise_floor") for r in rows)
    table = Table(title=f"Fidelity vs full recomputation ({model})")
    cols = ["layout", "items", "policy", "prompt", "recomputed", "KL first"]
    cols += ["KL / floor"] if floored else []
    cols += ["KL no items", "effect kept", "agree@32", "exact prefix", "ROUGE-L", "TTFT ms"]
    for col in [*cols, "scout"]:
        table.add_column(col, justify="left" if col in ("policy", "layout") else "right")
    for r in rows:
        kept = r.get("effect_kept")
        cells = [
            r.get("layout", "user"),
            str(r["documents"]),
            r["policy"],
            str(r["prompt_tokens"]),
            f"{r['recomputed_fraction']:.1%}",
            kl_text(r["kl_first"]),
        ]
        cells += [over_text(r.get("kl_over_floor"))] if floored else []
        cells += [
            f"{r['kl_no_items']:.3f}",
            "-" if kept is None else f"{kept:.1%}",
            f"{r['agreement_32']:.2f}",
            f"{r['exact_prefix']:.1f}",
            f"{r['rouge_l']:.3f}",
            f"{r['ttft_ms']:.0f}",
            f"{r['scout_tokens']:.0f} x {r['scout_layers']}" if r["scout_layers"] else "-",
        ]
        table.add_row(*cells)
    Console(width=200).print(table)


def _group(row: dict[str, Any]) -> tuple[str, int]:
    return (row.get("layout", "user"), row["documents"])


FLOOR_COLORS = ("crimson", "darkorange", "purple", "teal")
FLOOR_SPAN = 1e3
"""A noise floor's KL more than this factor below every policy's is named under the KL axis, not
drawn (a float32 floor near 1e-11 would squash the policies into a corner of the log axis)."""


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """KL of the first token (log scale; exact rows left out) and ROUGE-L against recomputed
    fraction: colour = policy, marker = document count; the mpic-k and boundary-k families are
    joined by a line per document count. Noise-floor rows are horizontal lines across both
    panels (colour = floor, line style = document count): how far beyond noise a policy lies."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_k, ax_r) = plt.subplots(1, 2, figsize=(14, 5.5))
    counts = sorted({(r.get("layout", "user"), r["documents"]) for r in rows})
    markers = dict(zip(counts, "osD^v<>p*", strict=False))
    floor_rows = [r for r in rows if r.get("noise_floor")]
    rows = [r for r in rows if not r.get("noise_floor")]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    cmap = plt.get_cmap("tab20")
    colors = {p: cmap(i % 20) for i, p in enumerate(policies)}
    for r in rows:
        x, kw = r["recomputed_fraction"], {"color": colors[r["policy"]], "s": 36}
        if r["kl_first"] > 0:
            ax_k.scatter(x, r["kl_first"], marker=markers[_group(r)], **kw)
        ax_r.scatter(x, r["rouge_l"], marker=markers[_group(r)], **kw)
    for family, style in (("mpic-", "-"), ("boundary-", "--"), ("scout-", ":")):
        for n in counts:
            line = sorted(
                (r for r in rows if _group(r) == n and r["policy"].startswith(family)),
                key=lambda r: r["recomputed_fraction"],
            )
            if len(line) > 1:
                xs = [r["recomputed_fraction"] for r in line]
                ax_k.plot(xs, [max(r["kl_first"], KL_FLOOR) for r in line], "k" + style, lw=0.7)
                ax_r.plot(xs, [r["rouge_l"] for r in line], "k" + style, lw=0.7)
    handles = [
        plt.Line2D([], [], color=colors[p], marker="o", ls="", label=p) for p in policies
    ] + [
        plt.Line2D([], [], color="grey", marker=markers[n], ls="", label=f"{n[0]}, {n[1]} items")
        for n in counts
    ]
    floor_handles, notes = _plot_floors(ax_k, ax_r, floor_rows, rows, counts, plt)
    handles += floor_handles
    ax_k.set_yscale("log")
    ax_k.set_xlabel("\n".join(["recomputed fraction of prompt tokens", *notes]))
    ax_k.set_ylabel("first-token KL vs full (nats; exact policies not shown)")
    ax_r.set_xlabel("recomputed fraction of prompt tokens")
    ax_r.set_ylabel("ROUGE-L F1 vs the exact 32-token answer")
    ax_r.legend(handles=handles, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(
        "Fidelity against recomputed tokens (lines: mpic-k solid, boundary-k dashed, scout dotted"
        + ("; horizontal: noise floors)" if floor_rows else ")")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_floors(
    ax_k: Any,
    ax_r: Any,
    floor_rows: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    counts: list[tuple[str, int]],
    plt: Any,
) -> tuple[list[Any], list[str]]:
    """Draw the noise floors as horizontal lines; their legend handles and notes for the floors
    whose KL is not drawn (far below every policy's, or 0)."""
    names = list(dict.fromkeys(r["policy"] for r in floor_rows))
    color = {p: FLOOR_COLORS[i % len(FLOOR_COLORS)] for i, p in enumerate(names)}
    style = {n: ("-", "--", "-.", ":")[i % 4] for i, n in enumerate(counts)}
    policy_kls = [r["kl_first"] for r in rows if r["kl_first"] > 0]
    lowest = min(policy_kls) / FLOOR_SPAN if policy_kls else 0.0
    notes = []
    handles = []
    for r in floor_rows:
        kw = {"color": color[r["policy"]], "ls": style[_group(r)], "lw": 1.0}
        label = f"{r['policy']}, {r.get('layout', 'user')} {r['documents']}"
        if r["kl_first"] > lowest:
            ax_k.axhline(r["kl_first"], **kw)
        elif r["kl_first"] > 0:
            notes.append(f"{label}: KL {r['kl_first']:.1e} (below the axis)")
        else:
            notes.append(f"{label}: KL 0 (bit-identical)")
        ax_r.axhline(r["rouge_l"], **kw)
        handles.append(plt.Line2D([], [], label=label, **kw))
    return handles, notes


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
    threads: int = typer.Option(None, "--threads", help="torch CPU threads (default: torch's)."),
    json_out: str = typer.Option(None, "--json", help="Write the JSON results here."),
    plot_out: str = typer.Option(None, "--plot", help="Write the PNG plot here."),
) -> None:
    """Answer fidelity per policy on a trained model with cached text documents."""
    from mpic.benchmarks.noise_floor import make_floor, parse_floors
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

    from mpic.engine.hf.reference_runner import ReferenceRunner

    if threads:
        torch.set_num_threads(threads)
    try:
        runner = ReferenceRunner(
            model, decode_correction=decode_correction, link_prefix=link_prefix
        )
        floors = [make_floor(runner, model, name) for name in floor_names]
    except (FileNotFoundError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    from rich.progress import Progress

    with Progress() as progress:
        if calibrate_vlcache is not None:
            name = calibrate_vlcache_on_documents(
                runner, calibrate_vlcache, calibration_grid, 4, 2, progress=progress
            )
            progress.console.print(
                f"calibrated VLCache schedule (r_bar {calibrate_vlcache:g}): {name}"
            )
            names.append(name)
        rows = []
        for layout in chosen_layouts if items == "documents" else ["user"]:
            rows += run_fidelity(
                runner,
                counts,
                names,
                questions,
                chars,
                progress=progress,
                layout=layout,
                items=items,
                first_question=first_question,
                floors=floors,
            )
        task_rows = None
        if task == "needle":
            from mpic.benchmarks.fidelity_task import run_task

            docs = passages(max(counts), chars)
            task_rows = run_task(
                runner,
                docs,
                counts,
                names,
                trials,
                progress=progress,
                seed=task_seed,
                floors=floors,
            )
    print_table(rows, model)
    doc: dict[str, Any] = {"model": str(Path(model).resolve()), "results": rows}
    if task_rows is not None:
        from mpic.benchmarks.fidelity_task import print_task_table

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
