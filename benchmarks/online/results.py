"""The open loop's results of `mpic bench online` (CLI process): `RatePoint` (one system at one
offered rate: TTFT p50 / p95 / p99, throughput), `SystemCurve` (one system's points and the
saturation rule: the highest grid rate whose TTFT stays under 2x the system's unloaded TTFT), the
`summary` of a model's curves (saturation per system, each MPIC system's ratio to vLLM prefix
caching, TTFT at half of prefix caching's saturation rate), and their outputs: `online.json`,
`online.png` and the printed table (`write_outputs`, `load_results`, `print_table`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RatePoint:
    """One system at one offered rate."""

    rate: float
    requests: int
    ttft_p50_ms: float
    ttft_p95_ms: float
    ttft_p99_ms: float
    throughput: float
    """Answers per second over the run (first arrival to last answer)."""
    ttfts_ms: list[float] = field(default_factory=list)
    """Every request's TTFT, in arrival order."""
    grid: bool = True
    """A rate of the grid (False: the extra point at half of prefix caching's saturation)."""


@dataclass
class SystemCurve:
    """One system's curve on one model."""

    system: str
    unloaded_ttft_ms: float
    unloaded_samples_ms: list[float] = field(default_factory=list)
    """TTFTs of the requests sent one at a time after 1 s idle (median: the bound's base)."""
    unloaded_hot_ms: list[float] = field(default_factory=list)
    """The same requests sent back to back."""
    points: list[RatePoint] = field(default_factory=list)
    fallbacks: int = 0
    """Linked requests answered by exact recomputation (an entry did not load): 0 expected."""

    def holds(self, point: RatePoint, stat: str = "p99") -> bool:
        """True when `point`'s p99 (or p95 / p50) TTFT is under 2x the unloaded TTFT."""
        return getattr(point, f"ttft_{stat}_ms") < 2 * self.unloaded_ttft_ms

    def saturation(self, stat: str = "p99") -> float:
        """Highest grid rate whose TTFT `stat` stays under 2x the unloaded TTFT (0.0: none)."""
        return max((p.rate for p in self.points if p.grid and self.holds(p, stat)), default=0.0)

    def first_failure(self, stat: str = "p99") -> float | None:
        """Lowest grid rate whose TTFT `stat` is not under 2x the unloaded TTFT (None: none)."""
        return min((p.rate for p in self.points if p.grid and not self.holds(p, stat)),
                   default=None)  # fmt: skip

    def stopped(self) -> bool:
        """True once the system is past its bound for good: the last grid point's p50, or the
        last two grid points' p99, not under 2x unloaded."""
        grid = [p for p in self.points if p.grid]
        return bool(grid) and (
            not self.holds(grid[-1], "p50")
            or (len(grid) > 1 and not self.holds(grid[-1]) and not self.holds(grid[-2]))
        )

    def at(self, rate: float) -> RatePoint | None:
        """The point measured at `rate` (None if none)."""
        return next((p for p in self.points if abs(p.rate - rate) < 1e-9), None)


def summary(curves: list[SystemCurve]) -> dict[str, Any]:
    """Saturation rate of each system (p99 rule; the same rule on p95 and p50), each MPIC system's
    ratio to vLLM prefix caching (a lower bound `>= x` when prefix caching held at no rate), and
    TTFT at half of prefix caching's saturation rate."""
    out: dict[str, Any] = {}
    prefix = next((c for c in curves if c.system == "prefix"), None)
    mpic = [c for c in curves if c.system not in ("prefix", "full")]
    for stat in ("p99", "p95", "p50"):
        out[f"saturation_rate_{stat}"] = {c.system: c.saturation(stat) for c in curves}
        out[f"first_failing_rate_{stat}"] = {c.system: c.first_failure(stat) for c in curves}
        if prefix is None:
            continue
        base = prefix.saturation(stat)
        if base:
            out[f"ratio_vs_prefix_{stat}"] = {c.system: c.saturation(stat) / base for c in mpic}
        else:  # prefix caching held at no measured rate: below the grid's lowest
            low = min((p.rate for p in prefix.points), default=0.0)
            out[f"ratio_vs_prefix_{stat}"] = {
                c.system: f">= {c.saturation(stat) / low:g}" if low and c.saturation(stat) else None
                for c in mpic
            }
    if prefix is not None:
        half = prefix.saturation() / 2
        out["half_prefix_rate"] = half
        out["ttft_at_half_prefix_rate_ms"] = {
            c.system: (
                {"p50": p.ttft_p50_ms, "p95": p.ttft_p95_ms, "p99": p.ttft_p99_ms}
                if half and (p := c.at(half))
                else None
            )
            for c in curves
        }
    return out


def load_results(path: Path) -> tuple[dict[str, list[SystemCurve]], dict]:
    """(curves per model, meta) of an `online.json`."""
    doc = json.loads(path.read_text())
    results = {}
    for m, v in doc["models"].items():
        curves = []
        for c in v["curves"]:
            points = [RatePoint(**p) for p in c.pop("points")]
            curves.append(SystemCurve(**c, points=points))
        results[m] = curves
    return results, doc["meta"]


def write_outputs(results: dict[str, list[SystemCurve]], meta: dict, out: Path) -> None:
    """`online.json` and `online.png` (per model: TTFT p50 / p99 and throughput vs rate)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "meta": meta,
        "models": {
            m: {"curves": [asdict(c) for c in curves], "summary": summary(curves)}
            for m, curves in results.items()
        },
    }
    (out / "online.json").write_text(json.dumps(payload, indent=1))
    fig, axes = plt.subplots(len(results), 2, figsize=(12, 4.5 * len(results)), squeeze=False)
    for row, (m, curves) in enumerate(results.items()):
        ax_t, ax_x = axes[row]
        for c in curves:
            rates = [p.rate for p in c.points]
            line = ax_t.plot(
                rates, [p.ttft_p50_ms for p in c.points], "o-", label=f"{c.system} p50"
            )
            color = line[0].get_color()
            ax_t.plot(rates, [p.ttft_p99_ms for p in c.points], "x--", color=color,
                      label=f"{c.system} p99")  # fmt: skip
            ax_t.axhline(2 * c.unloaded_ttft_ms, color=color, linestyle=":", linewidth=0.8)
            ax_x.plot(rates, [p.throughput for p in c.points], "o-", label=c.system)
        ax_t.set_xscale("log")
        ax_t.set_yscale("log")
        ax_t.set_xlabel("offered rate (requests/s)")
        ax_t.set_ylabel("TTFT (ms); dotted: 2x unloaded")
        ax_t.set_title(f"{m}: TTFT vs offered rate", fontsize=9)
        ax_t.legend(fontsize=7)
        ax_x.set_xscale("log")
        ax_x.set_xlabel("offered rate (requests/s)")
        ax_x.set_ylabel("throughput (answers/s)")
        sat = summary(curves)["saturation_rate_p99"]
        ax_x.set_title(f"{m}: saturation (p99 < 2x unloaded) {sat}", fontsize=8)
        ax_x.legend(fontsize=7)
        ticks = sorted({p.rate for c in curves for p in c.points})
        for ax in (ax_t, ax_x):  # the measured rates as the x labels
            ax.set_xticks(ticks, [f"{r:g}" for r in ticks], fontsize=7)
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    fig.tight_layout()
    fig.savefig(out / "online.png", dpi=110)
    plt.close(fig)


def print_table(results: dict[str, list[SystemCurve]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Online serving on one vLLM engine")
    for col in ["model", "system", "unloaded ms", "sat. p99 / p95", "rate: p50/p95/p99 ms, /s"]:
        table.add_column(col)
    for m, curves in results.items():
        for c in curves:
            pts = "; ".join(
                f"{p.rate:g}: {p.ttft_p50_ms:.0f}/{p.ttft_p95_ms:.0f}/{p.ttft_p99_ms:.0f} "
                f"{p.throughput:.2f}"
                for p in c.points
            )
            sat = f"{c.saturation():g} / {c.saturation('p95'):g}"
            table.add_row(m, c.system, f"{c.unloaded_ttft_ms:.0f}", sat, pts)
    Console().print(table)
    for m, curves in results.items():
        Console().print(m, json.dumps(summary(curves)))
