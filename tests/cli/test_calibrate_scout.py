"""`mpic model calibrate-scout` on a tiny model: the table it writes (S per half of the layers
unless --one-scale, and the scout's layers and question weight when another pair than the
default won) is the one the reference runner then names `auto` with, and every KL it printed is in
its JSON."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from typer.testing import CliRunner

from mpic.cli import app


def test_calibrate_scout_writes_the_table_the_runner_reads(tiny_llava_dir: Path, tmp_path) -> None:
    from mpic.engine.hf.reference_runner import ReferenceRunner
    from mpic.linker.policies import get_policy
    from mpic.linker.policies.registry import DEFAULT_BUDGET
    from mpic.linker.policies.scout_scales import TABLE_FILE, load_table

    model = tmp_path / "model"
    shutil.copytree(tiny_llava_dir, model)
    out = tmp_path / "kl.json"
    args = ["model", "calibrate-scout", "--model", str(model), "--budgets", "0.2,0.3"]
    args += ["--grid", "0.5,1.0", "--documents", "2", "--prompts", "1", "--write"]
    result = CliRunner().invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    table = json.loads((model / TABLE_FILE).read_text())["table"]
    data = json.loads(out.read_text())
    assert data["table"] == table and [row[0] for row in table] == [0.2, 0.3]
    for row, sweep in zip(table, data["kl"], strict=True):
        one = {float(s): kl for s, kl in sweep["kl"].items()}
        first = {float(s): kl for s, kl in sweep["first_half_kl"].items()}
        best = min(one, key=lambda s: (one[s], abs(s - 1.0)))
        assert row[-1] == best and set(first) == {0.5, 1.0}
        early = row[1] if len(row) == 3 else best
        assert first[early] == min(first.values())  # the row's first half is the sweep's best
        assert f"budget {row[0]:g}: S = " in result.output
    runner = ReferenceRunner(str(model))
    expected = get_policy(f"scout-{DEFAULT_BUDGET:g}", scales=load_table(model)).name
    assert get_policy("auto", scales=runner.scout_scales).name == expected
    assert f"`auto` now names {expected}" in result.output
    # the scout's fields first: the 2-layer model's one span, with weights 0 and 0.5, over
    # both budgets; the table spells the pair only when it is not the default
    tried = {(tuple(t["layers"]), t["question_weight"]): t["kl"] for t in data["scout_kl"]}
    assert set(tried) == {((1,), 0.0), ((1,), 0.5)} and "scout: layers 1-1" in result.output
    best = min(tried, key=lambda k: (tried[k], k != ((1,), 0.0)))
    written = json.loads((model / TABLE_FILE).read_text())
    if best == ((1,), 0.0):
        assert "scout" not in written and ":w" not in expected
    else:
        assert written["scout"] == {"layers": [1], "question_weight": 0.5}
        assert expected.endswith(":l1-1:w0.5")
    one = CliRunner().invoke(app, [*args[:-1], "--one-scale"])
    assert one.exit_code == 0, one.output
    assert "one S" in one.output


def test_calibrate_scout_refuses_bad_grids(tiny_llava_dir: Path) -> None:
    result = CliRunner().invoke(
        app, ["model", "calibrate-scout", "--model", str(tiny_llava_dir), "--grid", "0,3"]
    )
    assert result.exit_code == 2 and "--grid takes S in (0, 2]" in result.output


def test_calibrate_scout_refuses_bad_scout_fields(tiny_llava_dir: Path) -> None:
    """Spans past the model's layers, unparsable spans and negative weights: exit 2, a message."""
    base = ["model", "calibrate-scout", "--model", str(tiny_llava_dir)]
    for args, message in (
        (["--scout-layers", "1-5"], "past the model's 2 layers"),
        (["--scout-layers", "5-1"], "--scout-layers"),
        (["--question-weights", "-1"], "--question-weights takes weights in [0, 100]"),
    ):
        result = CliRunner().invoke(app, [*base, *args])
        assert result.exit_code == 2 and message in result.output, (args, result.output)
