"""The report of `mpic bench fidelity` (CLI process): its JSON rows (`policy_rows`), its table
(`print_table`) and its PNG (`plot`: KL and ROUGE-L against the recomputed fraction, one line
per policy family and document count, the noise floors as bands).
"""

from __future__ import annotations

import statistics
from typing import Any

from mpic.benchmarks.fidelity.noise_floor import kl_text

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


def policy_rows(
    per_policy: dict[str, list[dict[str, float]]],
    no_items: list[float],
    *,
    documents: int,
    layout: str,
    prompt_tokens: int,
    floors: dict[str, str],
    exact_decode: bool,
) -> list[dict[str, Any]]:
    """One JSON row per policy (`per_policy`'s order: full first, then the floors) of one item
    count: the means of its questions' samples, the effect kept against `no_items` (each
    question's KL(full || no items)), and `kl_over_floor` against the first floor (the row after
    full's; none without floors). floors: row label -> floor name."""
    kl_items = statistics.fmean(no_items)
    rows = []
    for policy, samples in per_policy.items():
        row: dict[str, Any] = {"policy": policy, "documents": documents}
        for key in ROW_KEYS[2:8]:
            row[key] = statistics.fmean(s[key] for s in samples)
        row["kl_no_items"] = kl_items
        row["effect_kept"] = 1.0 - row["kl_first"] / kl_items if kl_items > 0 else None
        row["layout"] = layout
        row["scout_layers"] = max(s["scout_layers"] for s in samples)
        row["scout_tokens"] = statistics.fmean(s["scout_tokens"] for s in samples)
        row["prompt_tokens"] = prompt_tokens
        row["kl_per_question"] = [s["kl_first"] for s in samples]
        row["agreement_per_question"] = [s["agreement_32"] for s in samples]
        row["kl_no_items_per_question"] = list(no_items)
        row["noise_floor"] = floors.get(policy)
        row["exact_decode"] = exact_decode
        rows.append(row)
    base = rows[1]["kl_first"] if floors else 0.0
    for row in rows:
        over = base > 0 and row["noise_floor"] is None
        row["kl_over_floor"] = row["kl_first"] / base if over else None
    return rows


KL_FLOOR = 1e-6
"""KL values below this are drawn at it (a log axis)."""


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
