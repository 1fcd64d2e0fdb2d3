"""S, the linked-key correction's scale, per recompute budget: its calibration (linker; CLI
`mpic model calibrate-scout`; its tables are read by `mpic.linker.policies.scout_scales`).

`calibrate_scale` finds, per budget, the S minimising the mean first-token KL against full
recomputation over proxy prompts by a grid search, then (`per_half`) the first half's S with the
second half's held at that best S, by a second sweep of the same grid (a coordinate search:
2 x |grid| points, not |grid|^2). The scout's selection is made once per prompt and budget: S
does not change which tokens the scout picks unless the scout itself is corrected, which it is
not by default.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass
class ScaleSweep:
    """The result of `calibrate_scale` for one budget."""

    budget: float
    best: float
    """The S with the lowest mean KL, one S in every layer."""
    kl: dict[float, float]
    """Mean first-token KL per S tried (one S in every layer)."""
    early: float | None = None
    """With `per_half`: the first half's S with the second half at `best` (== `best` when no
    other first-half S lowered the KL); None: not swept."""
    early_kl: dict[float, float] | None = None
    """Mean first-token KL per first-half S tried (second half at `best`)."""

    @property
    def row(self) -> tuple[float, ...]:
        """The table row: (budget, S), or (budget, S first half, S second half)."""
        if self.early is None or self.early == self.best:
            return (self.budget, self.best)
        return (self.budget, self.early, self.best)

    @property
    def best_kl(self) -> float:
        """The mean KL of the row's scales."""
        if self.early_kl is not None and self.early is not None:
            return self.early_kl[self.early]
        return self.kl[self.best]


def _argmin(kl: dict[float, float], prefer: float = 1.0) -> float:
    """The S of the lowest KL (ties: the S closest to `prefer`; 1 is the gentler correction)."""
    return min(kl, key=lambda s: (kl[s], abs(s - prefer)))


def calibrate_scale(
    kl_at: Callable[[float, float, float], float],
    budgets: Sequence[float],
    grid: Sequence[float],
    per_half: bool = True,
) -> list[ScaleSweep]:
    """For each budget, the S in `grid` minimising `kl_at(budget, S, S)`, then (`per_half`) the
    first half's S in `grid` minimising `kl_at(budget, S_first, S)` with the second half at that
    S. `kl_at(budget, S_first, S_second)`: the mean first-token KL of
    `scout-<budget>:s<S_first>/<S_second>` against full recomputation over the caller's proxy
    prompts."""
    out = []
    for budget in budgets:
        kl = {s: kl_at(budget, s, s) for s in grid}
        sweep = ScaleSweep(budget, _argmin(kl), kl)
        if per_half:
            early_kl = {
                s: (kl[s] if s == sweep.best else kl_at(budget, s, sweep.best)) for s in grid
            }
            early_kl[sweep.best] = kl[sweep.best]
            sweep.early, sweep.early_kl = _argmin(early_kl, prefer=sweep.best), early_kl
        out.append(sweep)
    return out
