"""`mpic-admin library ... --server URL` against the session's real Ray Serve instance: the
admin CLI's HTTP client drives refresh, list, show and rollback through the admin routes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.deployments.conftest import ADMIN_KEY, ServeApp, png

pytestmark = pytest.mark.slow


def test_admin_cli_over_http(serve_app: ServeApp, tmp_path: Path) -> None:
    from mpic.cli.admin import app

    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(2):
        (folder / f"p{i}.png").write_bytes(png(200 + i))
    server = ["--server", serve_app.url, "--api-key", ADMIN_KEY]
    cli = CliRunner()

    def run(*args: str):
        return cli.invoke(app, ["library", *args, *server])

    first = run("refresh", str(folder), "--collection", "refs", "--no-progress")
    assert first.exit_code == 0, first.output
    (folder / "p2.png").write_bytes(png(202))
    second = run("refresh", str(folder), "--collection", "refs", "--no-progress")
    assert second.exit_code == 0, second.output
    listed = json.loads(run("list", "--json").output)
    row = next(r for r in listed if r["collection"] == "refs")
    assert row["items"] == 3  # the current version's count, as the local list prints it
    assert f"refs\t{row['current']}\t3 items" in run("list").output
    shown = json.loads(run("show", "--collection", "refs", "--json").output)
    assert (
        len(shown["versions"]) == 2 and shown["current"] == row["current"] == shown["versions"][-1]
    )
    back = run("rollback", shown["versions"][0], "--collection", "refs")
    assert back.exit_code == 0, back.output
    shown = json.loads(run("show", "--collection", "refs", "--json").output)
    assert shown["current"] == shown["versions"][0]
    missing = run("show", "--collection", "nope", "--json")
    assert missing.exit_code == 2 and "server answered 404" in missing.output
    user = cli.invoke(app, ["library", "list", "--server", serve_app.url, "--api-key", "alice-key"])
    assert user.exit_code == 2 and "403" in user.output
