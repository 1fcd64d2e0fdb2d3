"""`mpic bench linking --policies`: the batching runs take any policy (every policy joins the
worker's batched pass); a name that does not parse is a usage error (exit 2) before any model
is written or engine started."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from mpic.cli import app


def test_a_bad_policy_is_refused_before_any_engine_starts(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "linking",
            "--policies",
            "full-reuse,bogus",
            "--model",
            str(tmp_path / "none"),
            "--out",
            str(out),
        ],  # fmt: skip
    )
    assert result.exit_code == 2
    assert "unknown policy 'bogus'" in result.output
    assert not out.exists()  # nothing ran
