"""`mpic bench retriever` at small sizes: table, JSON rows and PNG; flat recall is exact."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from mpic.cli import app


def test_bench_retriever_small(tmp_path) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "retriever",
            "--vectors",
            "800,2000",
            "--dim",
            "32",
            "--queries",
            "30",
            "--json",
            str(out),
            "--plot",
            str(png),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "FAISS retriever benchmark" in result.stdout
    rows = json.loads(out.read_text())["rows"]
    kinds = ["flat", "ivf", "ivf", "hnsw", "hnsw"]
    assert [(r["vectors"], r["kind"]) for r in rows] == [(n, k) for n in (800, 2000) for k in kinds]
    assert [r["search"] for r in rows[:5]] == [
        "-",
        "nprobe=16",
        "nprobe=64",
        "ef_search=64",
        "ef_search=256",
    ]
    for r in rows:
        assert r["build_s"] >= 0 and 0 < r["p50_ms"] <= r["p99_ms"]
        assert (r["recall@10"] == 1.0) if r["kind"] == "flat" else (0.5 <= r["recall@10"] <= 1.0)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = CliRunner().invoke(app, ["bench", "retriever", "--vectors", "ten"])
    assert bad.exit_code != 0 and "--vectors" in bad.output
