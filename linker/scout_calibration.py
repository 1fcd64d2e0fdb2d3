"""S, the linked-key correction's scale, per recompute budget: the default table and its
calibration (linker; CLI `mpic model calibrate-scout`, and wherever a `scout-*` name is resolved).

S depends on how much is recomputed: the fewer item tokens are recomputed, the gentler the best
S (APE's scale compensates the linked keys' excess attention, and recomputed tokens already
remove part of it). A table maps budget fractions to S; between rows S is interpolated
linearly, outside them the nearest row is used. `calibrate_scale` finds the S minimising the
mean first-token KL against full recomputation over proxy prompts, per budget, by a grid search
(the scout's selection is made once per prompt and budget: S does not change which tokens the
scout picks unless the scout itself is corrected, which it is not by default).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TABLE: tuple[tuple[float, float], ...] = (
    (0.0, 0.9),
    (0.1, 0.85),
    (0.2, 0.8),
    (0.3, 0.8),
    (0.5, 0.9),
    (1.0, 1.0),
)
"""(budget fraction, S) measured on the trained SmolLM2-135M (docs/fidelity.md); S of the
second half of the layers (and of all layers where `DEFAULT_EARLY` gives the same)."""

DEFAULT_EARLY: tuple[tuple[float, float], ...] = (
    (0.0, 0.9),
    (0.1, 0.85),
    (0.2, 0.9),
    (0.3, 0.9),
    (0.5, 0.9),
    (1.0, 1.0),
)
"""(budget fraction, S of the first half of the layers): at 20-30% recomputed a gentler S in
the first half (0.9 / 0.8) beat one S everywhere on SmolLM2 (docs/fidelity.md, "what we
tried"); budgets not measured that way keep one S."""

TABLE_FILE = "mpic_scout_scales.json"
"""Where `mpic model calibrate-scout --write` puts a model's own table (in its folder)."""


def interpolate(table: Sequence[tuple[float, float]], budget: float) -> float:
    """S at `budget` from a (budget, S) table sorted by budget (linear between rows)."""
    rows = sorted(table)
    if budget <= rows[0][0]:
        return rows[0][1]
    for (b0, s0), (b1, s1) in zip(rows, rows[1:], strict=False):
        if budget <= b1:
            return s0 + (s1 - s0) * (budget - b0) / (b1 - b0)
    return rows[-1][1]


def default_scale(budget: float) -> float:
    """S for `budget` from the default (SmolLM2) table, rounded to 3 decimals (the second half's
    S; `default_scales` gives both halves)."""
    return round(interpolate(DEFAULT_TABLE, budget), 3)


def default_scales(budget: float) -> tuple[float, float]:
    """(S of the first half of the layers, S of the second half) for `budget` from the default
    tables, rounded to 3 decimals."""
    return round(interpolate(DEFAULT_EARLY, budget), 3), default_scale(budget)


def load_table(model_dir: str | Path) -> list[tuple[float, float]] | None:
    """A model's own table (`TABLE_FILE` in its folder), or None."""
    path = Path(model_dir) / TABLE_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return [(float(b), float(s)) for b, s in data["table"]]


@dataclass
class ScaleSweep:
    """The result of `calibrate_scale` for one budget."""

    budget: float
    best: float
    """The S with the lowest mean KL."""
    kl: dict[float, float]
    """Mean first-token KL per S tried."""


def calibrate_scale(
    kl_at: Callable[[float, float], float], budgets: Sequence[float], grid: Sequence[float]
) -> list[ScaleSweep]:
    """For each budget, the S in `grid` minimising `kl_at(budget, S)` (the mean first-token KL of
    `scout-<budget>:s<S>` against full recomputation over the caller's proxy prompts)."""
    out = []
    for budget in budgets:
        kl = {s: kl_at(budget, s) for s in grid}
        out.append(ScaleSweep(budget, min(kl, key=lambda s: (kl[s], abs(s - 1.0))), kl))
    return out
