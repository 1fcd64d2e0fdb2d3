"""`mpic bench storage` end to end on tiny sizes: table, JSON rows and PNG are produced."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from mpic.cli import app


def test_bench_storage_small(tmp_path) -> None:  # noqa: ANN001
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    res = CliRunner().invoke(
        app,
        [
            "bench",
            "storage",
            "--sizes",
            "0.25,0.5",
            "--repeat",
            "2",
            "--json",
            str(out),
            "--plot",
            str(png),
            "--workdir",
            str(tmp_path),
        ],
    )
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())["rows"]
    assert [(r["size_mib"], r["tier"]) for r in rows] == [
        (s, t) for s in (0.25, 0.5) for t in ("memory", "disk-cold", "disk-warm")
    ]
    for r in rows:
        assert r["bytes"] > r["size_mib"] * 0.9 * (1 << 20)
        assert r["entry_MiB_s"] > 0 and r["raw_MiB_s"] > 0
        assert abs(r["ratio"] - r["entry_MiB_s"] / r["raw_MiB_s"]) < 1e-9
    assert png.stat().st_size > 10_000 and "disk-cold" in res.output
    bad = CliRunner().invoke(app, ["bench", "storage", "--sizes", "a,b"])
    assert bad.exit_code != 0
