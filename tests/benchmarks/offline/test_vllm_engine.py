"""`mpic bench offline --engine vllm` end to end on the tiny LLaVA (a child process, as users
run it: vLLM spawns its engine processes and they all exit with the command)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_bench_offline_with_vllm_writes_table_json_and_plot(
    tiny_llava_dir: Path, tmp_path: Path
) -> None:
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    cli = Path(sys.executable).parent / "mpic"
    proc = subprocess.run(
        [
            str(cli),
            "bench",
            "offline",
            "--model",
            str(tiny_llava_dir),
            "--engine",
            "vllm",
            "--images",
            "2",
            "--policies",
            "full,prefix,mpic-4",
            "--repeats",
            "1",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MPIC offline benchmark" in proc.stdout
    doc = json.loads(out_json.read_text())
    assert doc["engine"] == "vllm"
    rows = {r["policy"]: r for r in doc["results"]}
    assert set(rows) == {"full", "prefix", "mpic-4"}
    n = rows["full"]["prompt_tokens"]
    assert rows["prefix"]["prompt_tokens"] == rows["mpic-4"]["prompt_tokens"] == n
    assert rows["mpic-4"]["recomputed_tokens"] < n  # text + 4 tokens of each image
    assert rows["prefix"]["kl_vs_full"] < 1e-6 and rows["prefix"]["token_agreement"] == 1.0
    assert all(r["ttft_ms"] > 0 and r["cpu_ms"] > 0 for r in rows.values())
    assert out_png.stat().st_size > 1000
