"""S, the linked-key correction's scale, per recompute budget: the default tables and a model's
own (linker; read wherever a `scout-*` name is resolved; made by `mpic.linker.calibration.scout`).

S depends on how much is recomputed (APE's scale compensates the linked keys' excess attention, and
recomputed tokens already remove part of it) and on what an entry was computed after: with the
canonical context's lead-in (`mpic.linker.prompt.CONTEXT_LEAD_IN`) the best S is gentler in the
first half of the layers (0.95-0.975) than in the second (0.85-0.9). A table maps budget fractions
to S: rows (budget, S) for one S in every layer, or (budget, S of the first half of the layers, S of
the second half); between rows S is interpolated linearly, outside them the nearest row is used.
A model's own table (`ScoutTable`, `mpic model calibrate-scout --write`) may also carry the
scout's scoring layers and question weight.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

DEFAULT_TABLE: tuple[tuple[float, float], ...] = (
    (0.0, 0.85),
    (0.1, 0.85),
    (0.2, 0.85),
    (0.3, 0.9),
    (0.5, 0.95),
    (1.0, 1.0),
)
"""(budget fraction, S) measured on the trained SmolLM2-135M with the canonical context's lead-in
(docs/fidelity.md, "The canonical context's lead-in": chosen on the benchmark's questions 0-3 at
4 and 8 documents); S of the second half of the layers (and of all layers where `DEFAULT_EARLY`
gives the same). Applied to prompts whose linked items are mostly documents; mostly-image
prompts take `mpic.linker.policies.scout.IMAGE_SCALE`."""

DEFAULT_EARLY: tuple[tuple[float, float], ...] = (
    (0.0, 0.95),
    (0.1, 0.95),
    (0.15, 0.975),
    (0.2, 0.975),
    (0.3, 0.95),
    (0.5, 0.95),
    (1.0, 1.0),
)
"""(budget fraction, S of the first half of the layers): gentler than the second half's at every
budget (at 15-20%: 0.975 / 0.85 beat 0.95 / 0.85, 0.95 / 0.9 and one S; docs/fidelity.md)."""

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


@dataclass(frozen=True)
class ScoutTable(Sequence[tuple[float, ...]]):
    """A model's own scout calibration (`TABLE_FILE`): its (budget, S) or (budget, S first
    half, S second half) rows, read as the sequence of rows wherever a table is, and the
    scout's scoring layers and question weight where `calibrate-scout` chose them (None: the
    policy's defaults, `mpic.linker.policies.scout.scout_layers` and 0)."""

    rows: tuple[tuple[float, ...], ...]
    layers: tuple[int, ...] | None = None
    question_weight: float | None = None

    @overload
    def __getitem__(self, i: int) -> tuple[float, ...]: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[tuple[float, ...]]: ...
    def __getitem__(self, i: int | slice) -> tuple[float, ...] | Sequence[tuple[float, ...]]:
        return self.rows[i]

    def __len__(self) -> int:
        return len(self.rows)

    def to_json(self) -> dict[str, Any]:
        """The file's content: `{"table": rows}`, plus `"scout": {"layers", "question_weight"}`
        when either is set."""
        data: dict[str, Any] = {"table": [list(row) for row in self.rows]}
        if self.layers is not None or self.question_weight is not None:
            data["scout"] = {
                "layers": list(self.layers) if self.layers is not None else None,
                "question_weight": self.question_weight,
            }
        return data


def load_table(model_dir: str | Path, num_layers: int | None = None) -> ScoutTable | None:
    """A model's own table (`TABLE_FILE` in its folder; `ScoutTable.to_json`'s form); None
    without one, ValueError for a file that is not one, or whose scout layers a model of
    `num_layers` layers does not have (checked when given: the engines check at start-up)."""
    path = Path(model_dir) / TABLE_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        rows = tuple(tuple(float(x) for x in row) for row in data["table"])
        scout = data.get("scout") or {}
        layers = scout.get("layers")
        weight = scout.get("question_weight")
        table = ScoutTable(
            rows,
            tuple(sorted({int(x) for x in layers})) if layers else None,
            float(weight) if weight is not None else None,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: not a scout table ({exc})") from exc
    if table.layers and (table.layers[0] < 0 or (num_layers and table.layers[-1] >= num_layers)):
        raise ValueError(
            f"{path}: scout layers {list(table.layers)} outside the model's {num_layers}"
        )
    if table.question_weight is not None and not 0.0 <= table.question_weight <= 100.0:
        raise ValueError(f"{path}: question weight {table.question_weight} outside [0, 100]")
    return table


def table_scales(table: Sequence[Sequence[float]], budget: float) -> tuple[float, float]:
    """(S of the first half, S of the second half) at `budget` from a model's table (two-column
    rows: the same S for both halves), rounded to 3 decimals."""
    late = round(interpolate([(row[0], row[-1]) for row in table], budget), 3)
    early = round(interpolate([(row[0], row[1]) for row in table], budget), 3)
    return early, late
