"""The closed loop of the live fidelity guarantee (LLM-worker Serve replica): the server's default
recompute budget follows the drift the shadow passes measure
(`mpic.deployments.monitoring.fidelity_monitor`).

`BudgetController` is a bounded step controller with hysteresis. Samples (first-token KL of the
served pass against an exact prefill of the same prompt) are collected in a window; once the
window holds `min_samples`, one decision is taken on its mean m and the window is cleared:

    m > target                     -> budget <- min(budget + step, max_budget)   ("raise")
    m < target * (1 - hysteresis)  -> budget <- max(budget - step, min_budget)   ("lower")
    otherwise                      -> budget unchanged                            ("hold")

So the budget never leaves [min_budget, max_budget], moves at most `step` per `min_samples`
samples, and a drift inside the dead band [target * (1 - hysteresis), target] leaves it alone (no
oscillation around the target). The budget is a fraction of the prompt recomputed; it becomes a
policy through `budgeted` (the linker's budgeted policy when the registry has one; parsed once per
budget, not per request).
"""

from __future__ import annotations

import functools
import logging
import statistics
import threading
from dataclasses import dataclass
from typing import Literal

from mpic.linker.policies import Policy, get_policy

logger = logging.getLogger(__name__)

Decision = Literal["raise", "lower", "hold"]


@dataclass(frozen=True)
class ControllerBounds:
    """The loop's constants (`FidelityConfig` fields of the same names)."""

    target: float
    """Drift (mean first-token KL, nats) the loop keeps the sampled requests under."""
    min_budget: float
    max_budget: float
    step: float
    hysteresis: float
    """Lower only when the mean is below target * (1 - hysteresis)."""
    min_samples: int
    """Samples per decision."""


class BudgetController:
    """The default recompute budget, moved by sampled drift (thread-safe)."""

    def __init__(self, bounds: ControllerBounds, start: float) -> None:
        if not 0 < bounds.min_budget <= bounds.max_budget <= 1:
            raise ValueError(
                f"fidelity budgets must satisfy 0 < min_budget <= max_budget <= 1, got "
                f"{bounds.min_budget}, {bounds.max_budget}"
            )
        self.bounds = bounds
        self.budget = min(max(start, bounds.min_budget), bounds.max_budget)
        self.window: list[float] = []
        self.decisions: list[tuple[Decision, float, float]] = []
        """(decision, window mean, budget after) of every decision taken, oldest first."""
        self._lock = threading.Lock()

    def observe(self, kl: float) -> Decision | None:
        """Add one sample; the decision when this sample completed a window, else None."""
        b = self.bounds
        with self._lock:
            self.window.append(float(kl))
            if len(self.window) < b.min_samples:
                return None
            mean = statistics.fmean(self.window)
            self.window.clear()
            before = self.budget
            if mean > b.target:
                self.budget = min(round(before + b.step, 6), b.max_budget)
                decision: Decision = "raise"
            elif mean < b.target * (1.0 - b.hysteresis):
                self.budget = max(round(before - b.step, 6), b.min_budget)
                decision = "lower"
            else:
                decision = "hold"
            self.decisions.append((decision, mean, self.budget))
        if self.budget != before:
            logger.info(
                "fidelity loop: mean KL %.4g over %d samples (target %.4g): recompute budget "
                "%.3g -> %.3g",
                mean,
                b.min_samples,
                b.target,
                before,
                self.budget,
                extra={"fidelity_kl_mean": mean, "recompute_budget": self.budget},
            )
        return decision


def budget_policy(budget: float) -> str:
    """The name of the policy that recomputes about `budget` (`budgeted`)."""
    return budgeted(budget).name


@functools.lru_cache(maxsize=256)
def budgeted(budget: float) -> Policy:
    """The policy that recomputes about `budget` (a fraction of the prompt): the linker's best
    selection for a budget (`auto-<fraction>`, else `scout-<fraction>`) when the registry knows
    it, else `vlcache-<fraction>` (every text token plus the first `fraction` of each item's
    tokens, at every layer). Parsed once per budget (the loop moves it in steps, between
    bounds) and shared by the requests served at it (policies hold no per-request state)."""
    for name in (f"auto-{budget:g}", f"scout-{budget:g}", f"vlcache-{budget:g}"):
        try:
            return get_policy(name)
        except ValueError:
            continue
    raise ValueError(f"no budgeted policy accepts recompute budget {budget}")
