"""S, the linked-key correction's scale, per recompute budget: the default tables and a model's
own (linker; read wherever a `scout-*` name is resolved; made by `mpic.linker.calibration.scout`).

S depends on how much is recomputed: the fewer item tokens are recomputed, the gentler the best
S (APE's scale compensates the linked keys' excess attention, and recomputed tokens already
remove part of it). A table maps budget fractions to S: rows (budget, S) for one S in every
layer, or (budget, S of the first half of the layers, S of the second half); between rows S is
interpolated linearly, outside them the nearest row is used.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
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


def load_table(model_dir: str | Path) -> list[tuple[float, ...]] | None:
    """A model's own table (`TABLE_FILE` in its folder): rows (budget, S) or (budget, S of the
    first half, S of the second half); None without one."""
    path = Path(model_dir) / TABLE_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return [tuple(float(x) for x in row) for row in data["table"]]


def table_scales(table: Sequence[Sequence[float]], budget: float) -> tuple[float, float]:
    """(S of the first half, S of the second half) at `budget` from a model's table (two-column
    rows: the same S for both halves), rounded to 3 decimals."""
    late = round(interpolate([(row[0], row[-1]) for row in table], budget), 3)
    early = round(interpolate([(row[0], row[1]) for row in table], budget), 3)
    return early, late
