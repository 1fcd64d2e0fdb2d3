"""Scout's correction-scale table (`mpic.linker.calibration.scout`, read by
`mpic.linker.policies.scout_scales`): the per-budget calibration with S per half of the layers,
and how a model's table names the policy."""

from __future__ import annotations

import pytest

from mpic.linker.calibration.scout import calibrate_scale
from mpic.linker.policies import get_policy
from mpic.linker.policies.scout_scales import table_scales

GRID = [0.7, 0.8, 0.9, 1.0]


def _bowl(budget: float, early: float, late: float) -> float:
    """A KL surface whose minimum is at S 0.9 in the first half and 0.8 in the second."""
    return (early - 0.9) ** 2 + 2 * (late - 0.8) ** 2 + budget


def test_per_half_sweep_finds_both_scales() -> None:
    calls: list[tuple[float, float, float]] = []

    def kl_at(budget: float, early: float, late: float) -> float:
        calls.append((budget, early, late))
        return _bowl(budget, early, late)

    (sweep,) = calibrate_scale(kl_at, [0.2], GRID)
    assert sweep.best == 0.8 and sweep.early == 0.9  # one S first, then the first half
    assert sweep.row == (0.2, 0.9, 0.8)
    assert sweep.best_kl == pytest.approx(_bowl(0.2, 0.9, 0.8))
    assert sweep.best_kl < sweep.kl[sweep.best]
    assert len(calls) == 2 * len(GRID) - 1  # a coordinate search, not the whole grid squared
    assert {c[2] for c in calls[len(GRID) :]} == {0.8}  # second half held at the one-S best


def test_one_scale_sweep_and_rows_that_keep_one_scale() -> None:
    (one,) = calibrate_scale(_bowl, [0.3], GRID, per_half=False)
    assert one.early is None and one.row == (0.3, 0.8)
    (flat,) = calibrate_scale(lambda b, e, s: (s - 0.9) ** 2, [0.3], GRID)  # halves equal
    assert flat.row == (0.3, 0.9)


def test_a_models_table_names_the_policy() -> None:
    two = [(0.1, 0.7), (0.3, 0.6)]  # (budget, S): one S in every layer
    three = [(0.1, 0.95, 0.7), (0.3, 0.85, 0.6)]  # (budget, S first half, S second half)
    assert table_scales(two, 0.2) == (0.65, 0.65)
    assert table_scales(three, 0.2) == (0.9, 0.65)
    assert get_policy("scout-0.2", scales=two).name == "scout-0.2:s0.65"
    assert get_policy("scout-0.2", scales=three).name == "scout-0.2:s0.9/0.65"
    assert get_policy("auto-0.2", scales=three).name == "scout-0.2:s0.9/0.65"
    assert get_policy("auto", scales=three).name == "scout-0.18:s0.91/0.66"
    assert get_policy("auto-0.3", scales=three).name == "scout-0.3:s0.85/0.6"
    assert get_policy("scout-0.2:s0.8", scales=three).name == "scout-0.2:s0.8"  # spelled out wins
