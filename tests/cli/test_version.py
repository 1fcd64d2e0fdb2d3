"""`mpic --version` prints the installed distribution's version, as `vllm --version` does, and
the API's `/version` reports the same (`mpic.installed_version`)."""

from __future__ import annotations

from importlib.metadata import version

from typer.testing import CliRunner

from mpic.cli import app


def test_version_flag_prints_the_installed_version() -> None:
    res = CliRunner().invoke(app, ["--version"])
    assert res.exit_code == 0, res.output
    assert res.output.strip() == version("mpic-serve")
