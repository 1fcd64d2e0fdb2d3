"""The closed loop's results of `mpic bench online --closed-loop` (CLI process): `Level` (one
system at one number of concurrent clients: throughput, TTFT and ITL percentiles, latency),
`level_of` (a level from its chats' token times), `ClosedCurve` (one system's levels: its
capacity and the most clients under a TTFT bound), the `summary` of a model's curves, and their
outputs: `online_closed.json`, `online_closed.png` and the printed tables (`write_outputs`,
`load_results`, `print_table`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mpic.benchmarks.online import workload as wl


@dataclass
class Level:
    """One system at one number of concurrent clients."""

    clients: int
    chats: int
    span_s: float
    """From the start to the last answer (no chat is sent after `duration_s`)."""
    chats_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float | None
    itl_p95_ms: float | None
    itl_p99_ms: float | None
    itl_mean_ms: float | None
    latency_p50_ms: float
    """Submission to the last token."""
    prepare_p50_ms: float
    """Building a request (`VllmFrontEnd.prepare`), before submission: not in TTFT."""
    fallbacks: int = 0
    load_1m: float | None = None
    """The host's 1-minute load average after the level."""
    ttfts_ms: list[float] = field(default_factory=list)
    """Every chat's TTFT, in the order the chats were sent."""
    warmup_ttfts_ms: list[float] = field(default_factory=list)
    """TTFTs of the untimed round before the level (N chats sent together)."""


@dataclass
class ClosedCurve:
    """One system's levels on one model."""

    system: str
    levels: list[Level] = field(default_factory=list)

    def capacity(self) -> Level | None:
        """The level with the most chats per second (None: no level)."""
        return max(self.levels, key=lambda lv: lv.chats_per_s, default=None)

    def clients_under(self, bound_s: float, stat: str = "p95") -> int:
        """The most clients whose TTFT `stat` is under `bound_s` (0: at no level)."""
        ok = [lv.clients for lv in self.levels if getattr(lv, f"ttft_{stat}_ms") < 1e3 * bound_s]
        return max(ok, default=0)


def level_of(
    clients: int, t0: float, done: list[tuple[float, float, list[float]]], fallbacks: int = 0
) -> Level:
    """A level from its chats: (build seconds, submission time, token arrival times) each, in
    the order sent; `t0` the level's start."""
    ttfts = [times[0] - sent for _, sent, times in done]
    ends = [times[-1] for _, _, times in done]
    gaps = [g for _, _, times in done for g in np.diff(np.unique(times))]
    span = max(ends) - t0
    itl = wl.percentiles_ms(gaps) if gaps else [None] * 3
    return Level(
        clients=clients,
        chats=len(done),
        span_s=span,
        chats_per_s=len(done) / span,
        output_tokens_per_s=sum(len(times) for _, _, times in done) / span,
        ttft_p50_ms=(pct := wl.percentiles_ms(ttfts))[0],
        ttft_p95_ms=pct[1],
        ttft_p99_ms=pct[2],
        itl_p50_ms=itl[0],
        itl_p95_ms=itl[1],
        itl_p99_ms=itl[2],
        itl_mean_ms=1e3 * float(np.mean(gaps)) if gaps else None,
        latency_p50_ms=wl.percentiles_ms([t[-1] - s for _, s, t in done])[0],
        prepare_p50_ms=wl.percentiles_ms([b for b, _, _ in done])[0],
        fallbacks=fallbacks,
        ttfts_ms=[round(1e3 * t, 1) for t in ttfts],
    )


def summary(curves: list[ClosedCurve], bound_s: float) -> dict[str, Any]:
    """Capacity per system (chats/s, the level it came at, output tokens/s there), its ratio to
    vLLM prefix caching's, and the most clients whose p95 (and p99) TTFT stays under `bound_s`."""
    caps = {c.system: c.capacity() for c in curves}
    out: dict[str, Any] = {
        "ttft_bound_s": bound_s,
        "capacity_chats_per_s": {s: lv.chats_per_s if lv else None for s, lv in caps.items()},
        "capacity_clients": {s: lv.clients if lv else None for s, lv in caps.items()},
        "capacity_output_tokens_per_s": {
            s: lv.output_tokens_per_s if lv else None for s, lv in caps.items()
        },
        "clients_under_bound_p95": {c.system: c.clients_under(bound_s) for c in curves},
        "clients_under_bound_p99": {c.system: c.clients_under(bound_s, "p99") for c in curves},
    }
    base = caps.get("prefix")
    if base is not None and base.chats_per_s > 0:
        out["capacity_ratio_vs_prefix"] = {
            s: lv.chats_per_s / base.chats_per_s for s, lv in caps.items() if lv and s != "prefix"
        }
    return out


def load_results(path: Path) -> tuple[dict[str, list[ClosedCurve]], dict]:
    """(curves per model, meta) of an `online_closed.json`."""
    doc = json.loads(path.read_text())
    results = {
        m: [
            ClosedCurve(c["system"], [Level(**lv) for lv in c["levels"]])
            for c in v["curves"]
        ]
        for m, v in doc["models"].items()
    }  # fmt: skip
    return results, doc["meta"]


def write_outputs(results: dict[str, list[ClosedCurve]], meta: dict, out: Path) -> None:
    """`online_closed.json` and `online_closed.png` (per model: chats/s and p95 TTFT vs
    clients, one line per system; the TTFT bound dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    bound_s = meta["ttft_bound_s"]
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "meta": meta,
        "models": {
            m: {"curves": [asdict(c) for c in curves], "summary": summary(curves, bound_s)}
            for m, curves in results.items()
        },
    }
    (out / "online_closed.json").write_text(json.dumps(payload, indent=1))
    fig, axes = plt.subplots(len(results), 2, figsize=(12, 4.5 * len(results)), squeeze=False)
    for row, (m, curves) in enumerate(results.items()):
        ax_x, ax_t = axes[row]
        for c in curves:
            n = [lv.clients for lv in c.levels]
            ax_x.plot(n, [lv.chats_per_s for lv in c.levels], "o-", label=c.system)
            ax_t.plot(n, [lv.ttft_p95_ms for lv in c.levels], "o-", label=c.system)
        ax_t.axhline(1e3 * bound_s, color="gray", linestyle=":", linewidth=1,
                     label=f"bound {bound_s:g} s")  # fmt: skip
        ax_x.set_ylabel("throughput (chats/s)")
        ax_x.set_title(f"{m}: throughput vs concurrent clients", fontsize=9)
        ax_t.set_yscale("log")
        ax_t.set_ylabel("TTFT p95 (ms)")
        ax_t.set_title(f"{m}: p95 TTFT vs concurrent clients", fontsize=9)
        ticks = sorted({lv.clients for c in curves for lv in c.levels})
        for ax in (ax_x, ax_t):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent clients")
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "online_closed.png", dpi=110)
    plt.close(fig)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def print_table(results: dict[str, list[ClosedCurve]], bound_s: float) -> None:
    """Every level, then per system: capacity, its ratio to prefix caching's, clients under the
    bound."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="Closed loop on one vLLM engine: N clients, each sends on its answer")
    cols = ["model", "system", "clients", "chats", "chats/s", "out tok/s",
            "TTFT p50 / p95 / p99 ms", "ITL p50 / p99 ms"]  # fmt: skip
    for col in cols:
        table.add_column(col, justify="left" if col in ("model", "system") else "right")
    for m, curves in results.items():
        for c in curves:
            for lv in c.levels:
                table.add_row(
                    m, c.system, str(lv.clients), str(lv.chats), f"{lv.chats_per_s:.2f}",
                    f"{lv.output_tokens_per_s:.1f}",
                    f"{lv.ttft_p50_ms:.0f} / {lv.ttft_p95_ms:.0f} / {lv.ttft_p99_ms:.0f}",
                    f"{_ms(lv.itl_p50_ms)} / {_ms(lv.itl_p99_ms)}",
                )  # fmt: skip
    console.print(table)
    caps = Table(title=f"Capacity and clients with p95 TTFT < {bound_s:g} s")
    for col in ["model", "system", "capacity chats/s (clients)", "out tok/s there",
                "/ prefix", f"clients p95 < {bound_s:g} s", "p99 <"]:  # fmt: skip
        caps.add_column(col)
    for m, curves in results.items():
        s = summary(curves, bound_s)
        ratio = s.get("capacity_ratio_vs_prefix", {})
        for c in curves:
            lv = c.capacity()
            if lv is None:
                continue
            r = ratio.get(c.system)
            caps.add_row(
                m, c.system, f"{lv.chats_per_s:.2f} ({lv.clients})",
                f"{lv.output_tokens_per_s:.1f}", "1" if c.system == "prefix" else
                ("-" if r is None else f"{r:.2f}"),
                str(c.clients_under(bound_s)), str(c.clients_under(bound_s, "p99")),
            )  # fmt: skip
    console.print(caps)
    for m, curves in results.items():
        ratio = summary(curves, bound_s).get("capacity_ratio_vs_prefix")
        text = ", ".join(f"{k} {v:.2f}" for k, v in ratio.items()) if ratio else "no prefix"
        console.print(f"{m}: capacity(system) / capacity(prefix): {text}")
