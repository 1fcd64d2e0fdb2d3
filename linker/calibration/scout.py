"""S, the linked-key correction's scale, per recompute budget: its calibration (linker; CLI
`mpic model calibrate-scout`; its tables are read by `mpic.linker.policies.scout_scales`).

`calibrate_scale` finds, per budget, the S minimising the mean first-token KL against full
recomputation over proxy prompts by a grid search, then (`per_half`) the first half's S with the
second half's held at that best S, by a second sweep of the same grid (a coordinate search:
2 x |grid| points, not |grid|^2). The scout's selection is made once per prompt and budget: S
does not change which tokens the scout picks unless the scout itself is corrected, which it is
not by default.

`choose_scout` picks the scout's own fields before that: the scoring layers and the question
weight with the lowest mean KL over the budgets, at the default S (a coordinate search again: the
fields first, then S with them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mpic.linker.policies.scout import scout_layers


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


@dataclass
class ScoutChoice:
    """The result of `choose_scout`."""

    layers: tuple[int, ...]
    question_weight: float
    kl: dict[tuple[tuple[int, ...], float], float]
    """Mean KL over the budgets per (layers, question weight) tried."""
    default: tuple[tuple[int, ...], float]
    """The policy's default fields (the first candidate): kept on ties."""

    @property
    def is_default(self) -> bool:
        """The default layers and weight won (a table need not spell them)."""
        return (self.layers, self.question_weight) == self.default


def choose_scout(
    kl_at: Callable[[float, tuple[int, ...], float], float],
    budgets: Sequence[float],
    layer_spans: Sequence[Sequence[int]],
    weights: Sequence[float],
) -> ScoutChoice:
    """The (scoring layers, question weight) among `layer_spans` x `weights` of the lowest mean
    `kl_at(budget, layers, weight)` over `budgets` (the first span with the first weight is the
    default and wins ties). `kl_at`: the mean first-token KL of `scout-<budget>` with those
    fields and the default S against full recomputation over the caller's proxy prompts."""
    spans = [tuple(sorted({int(x) for x in span})) for span in layer_spans]
    if not spans or not weights or not budgets:
        raise ValueError("choose_scout needs budgets, layer spans and weights")
    kl = {}
    for span in spans:
        for weight in weights:
            key = (span, float(weight))
            if key not in kl:
                kl[key] = sum(kl_at(b, span, float(weight)) for b in budgets) / len(budgets)
    default = (spans[0], float(weights[0]))
    best = min(kl, key=lambda k: (kl[k], k != default))
    return ScoutChoice(best[0], best[1], kl, default)


CANDIDATE_SPANS = ((2 / 30, 5 / 30), (1 / 30, 8 / 30), (2 / 30, 8 / 30), (2 / 30, 12 / 30))
"""The scoring-layer spans `calibrate-scout` tries by default, as fractions of depth: the
default's 2-5 of SmolLM2's 30 layers first, then 1-8, 2-8 and 2-12, the deeper spans that
ranked best at 8 documents (docs/fidelity.md, "KL at 15%")."""


def candidate_spans(num_layers: int) -> list[tuple[int, ...]]:
    """`CANDIDATE_SPANS` at a model's depth (the default span first; duplicates dropped)."""
    spans: list[tuple[int, ...]] = []
    for fractions in CANDIDATE_SPANS:
        span = tuple(scout_layers(num_layers, fractions))
        if span not in spans:
            spans.append(span)
    return spans
