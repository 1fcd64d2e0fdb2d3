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


def test_choose_scout_takes_the_lowest_mean_kl_and_keeps_the_default_on_ties() -> None:
    """`choose_scout` tries every span with every weight, averages over the budgets, and keeps
    the first span with the first weight (the default) unless another pair is lower."""
    from mpic.linker.calibration.scout import candidate_spans, choose_scout

    calls = []

    def kl_at(budget, span, weight):
        calls.append((budget, span, weight))
        return budget + (0.1 if span == (2, 3, 4, 5) else 0.0) + abs(weight - 0.5)

    choice = choose_scout(kl_at, [0.1, 0.2], [(2, 3, 4, 5), (2, 3, 4, 5, 6, 7, 8)], [0.0, 0.5])
    assert (choice.layers, choice.question_weight) == ((2, 3, 4, 5, 6, 7, 8), 0.5)
    assert not choice.is_default and len(choice.kl) == 4 and len(calls) == 8
    assert choice.kl[((2, 3, 4, 5), 0.0)] == pytest.approx(0.15 + 0.1 + 0.5)
    flat = choose_scout(lambda b, s, w: 1.0, [0.2], [(3, 1), (1, 2)], [0.0, 1.0])
    assert flat.is_default and flat.layers == (1, 3) and flat.question_weight == 0.0
    assert candidate_spans(30) == [
        tuple(range(2, 6)), tuple(range(1, 9)), tuple(range(2, 9)), tuple(range(2, 13))
    ]  # fmt: skip
    assert candidate_spans(2) == [(1,)]  # every span collapses on a 2-layer model
    with pytest.raises(ValueError):
        choose_scout(kl_at, [0.2], [], [0.0])


def test_a_models_table_with_scout_fields_names_the_policy(tmp_path) -> None:
    """A table with the scout's layers and weight: names that do not spell `:l` / `:w` take
    them (parsed against the table, or a parsed policy `with_scales`), spelled ones win; the
    name spells them, so a second parse without the table (the vLLM connector's) agrees; the
    file round-trips, and a file that is not a table is a ValueError naming it."""
    import json

    from mpic.linker.policies.scout_scales import TABLE_FILE, ScoutTable, load_table

    table = ScoutTable(((0.1, 0.95, 0.7), (0.3, 0.85, 0.6)), (2, 3, 4, 5, 6, 7, 8), 0.5)
    assert list(table) == [(0.1, 0.95, 0.7), (0.3, 0.85, 0.6)] and table_scales(table, 0.2)
    for name, expected in (
        ("auto", "scout-0.18:s0.91/0.66:l2-8:w0.5"),
        ("scout-0.2", "scout-0.2:s0.9/0.65:l2-8:w0.5"),
        ("scout-0.2:s0.8", "scout-0.2:s0.8:l2-8:w0.5"),
        ("scout-0.2:l1-3", "scout-0.2:s0.9/0.65:l1-3:w0.5"),
        ("scout-0.2:w0", "scout-0.2:s0.9/0.65:l2-8:w0"),
        ("scout-0.2:k8:l4-4_9-10:w2", "scout-0.2:s0.9/0.65:k8:l4-4_9-10:w2"),
        ("mpic-32", "mpic-32"),
    ):
        assert get_policy(name, scales=table).name == expected, name
        assert get_policy(name).with_scales(table).name == expected, name
        assert get_policy(expected).name == expected  # the connector's parse, no table
        assert get_policy(expected, scales=table).name == expected  # a fixed point with it
    policy = get_policy("scout-0.2:l4-4_9-10:w2")
    assert policy.layers == [4, 9, 10] and policy.question_weight == 2.0
    (tmp_path / TABLE_FILE).write_text(json.dumps(table.to_json()))
    assert load_table(tmp_path) == table
    (tmp_path / TABLE_FILE).write_text(json.dumps({"table": [[0.2, 0.9]]}))
    assert load_table(tmp_path) == ScoutTable(((0.2, 0.9),))
    (tmp_path / TABLE_FILE).write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match=TABLE_FILE):
        load_table(tmp_path)
    (tmp_path / TABLE_FILE).write_text(json.dumps(table.to_json()))  # layers 2-8
    assert load_table(tmp_path, num_layers=9) == table
    with pytest.raises(ValueError, match="outside the model's 8"):
        load_table(tmp_path, num_layers=8)  # an engine of another depth refuses it at start-up


@pytest.mark.parametrize(
    "name",
    ["scout-0.2:w0.5:l2-3", "scout-0.2:l5-2", "scout-0.2:l-1", "scout-0.2:l2-99999",
     "scout-0.2:wx", "scout-0.2:w-1", "scout-0.2:wnan", "scout-0.2:l", "scout-0.2:l2-3:l4-5"],
)  # fmt: skip
def test_bad_scout_fields_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="bad policy"):
        get_policy(name)
