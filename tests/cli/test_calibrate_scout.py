"""`mpic model calibrate-scout` on a tiny model: the table it writes (S per half of the layers
unless --one-scale) is the one the reference runner then names `auto` with, and every KL it
printed is in its JSON."""

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
    from mpic.linker.policies.scout_scales import TABLE_FILE

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
    expected = get_policy(f"scout-{DEFAULT_BUDGET:g}", scales=table).name
    assert get_policy("auto", scales=runner.scout_scales).name == expected
    one = CliRunner().invoke(app, [*args[:-1], "--one-scale"])
    assert one.exit_code == 0, one.output
    assert "one S" in one.output


def test_calibrate_scout_refuses_bad_grids(tiny_llava_dir: Path) -> None:
    result = CliRunner().invoke(
        app, ["model", "calibrate-scout", "--model", str(tiny_llava_dir), "--grid", "0,3"]
    )
    assert result.exit_code == 2 and "--grid takes S in (0, 2]" in result.output
