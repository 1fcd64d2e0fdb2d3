"""`mpic bench offline` and `mpic demo` end to end on the tiny LLaVA: JSON shape, exactness of
policies that recompute everything, op counts of each row's prefill (`--top-ops`), plot
written, bad options rejected with exit code 2."""

import json
import re

import pytest
from typer.testing import CliRunner

from mpic.benchmarks.offline.bench import OP_FIELDS, op_fields, print_table
from mpic.cli import app

KEYS = {
    "policy",
    "images",
    "prompt_tokens",
    "recomputed_tokens",
    "ttft_ms",
    "kl_vs_full",
    "token_agreement",
    "cpu_ms",
    "floor_ms",
    "floor_ratio",
    "aten_ops",
    "aten_ops_per_layer",
    "syncs",
    "h2d_copies",
    "gpu_busy_ms",
    "gpu_busy_share",
    "kernels",
    "eager_falls",
    "compiled_graphs",
}
TOP = 3


@pytest.fixture(scope="module")
def bench(tiny_llava_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    args = [
        "bench",
        "offline",
        "--model",
        str(tiny_llava_dir),
        "--engine",
        "reference",
        "--images",
        "1,2",
        "--policies",
        "full,prefix,full-reuse,mpic-4,vlcache-0.5,mpic-16",
        "--repeats",
        "1",
        "--json",
        str(out / "r.json"),
        "--plot",
        str(out / "r.png"),
        "--top-ops",
        str(TOP),
    ]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    return json.loads((out / "r.json").read_text()), out, result.output


def test_json_shape_and_table(bench):
    doc, out, output = bench
    assert doc["engine"] == "reference" and doc["model"]
    assert len(doc["results"]) == 12
    assert all(set(r) == KEYS for r in doc["results"])
    assert "mpic-4" in output and "TTFT" in output
    assert (out / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_fidelity_columns(bench):
    rows = {(r["policy"], r["images"]): r for r in bench[0]["results"]}
    for n in (1, 2):
        # policies that recompute every token (prefix here: new text precedes the images)
        for exact in ("full", "prefix", "mpic-16"):  # tiny images have 16 tokens
            assert rows[exact, n]["kl_vs_full"] < 1e-6
            assert rows[exact, n]["token_agreement"] == 1.0
        for exact in ("full", "prefix"):
            assert rows[exact, n]["recomputed_tokens"] == rows[exact, n]["prompt_tokens"]
        # mpic-k links the template prefix exactly (mpic.linker.prefix): P tokens not recomputed
        p = rows["full", n]["prompt_tokens"] - rows["mpic-16", n]["recomputed_tokens"]
        assert p > 0
        assert rows["mpic-4", n]["kl_vs_full"] > 1e-6
        assert (
            rows["mpic-4", n]["recomputed_tokens"]
            == rows["mpic-4", n]["prompt_tokens"] - 12 * n - p
        )
    assert rows["full", 2]["prompt_tokens"] > rows["full", 1]["prompt_tokens"] + 16
    for r in rows.values():  # a plain forward of the recomputed tokens: timed, positive
        assert r["floor_ms"] > 0 and r["floor_ratio"] == pytest.approx(r["ttft_ms"] / r["floor_ms"])


def test_op_count_columns_on_the_cpu(bench, tiny_llava_dir):
    doc, _, output = bench
    text = json.loads((tiny_llava_dir / "config.json").read_text())["text_config"]
    layers = text["num_hidden_layers"]
    rows = {(r["policy"], r["images"]): r for r in doc["results"]}
    for r in rows.values():
        assert r["aten_ops"] > 0
        assert r["aten_ops_per_layer"] == pytest.approx(r["aten_ops"] / layers)
        # host and device are one on the CPU: syncs and copies are unknowable, not 0
        assert r["syncs"] is None and r["h2d_copies"] is None
        assert r["gpu_busy_ms"] is None and r["gpu_busy_share"] is None and r["kernels"] is None
        assert r["eager_falls"] == 0
        assert r["compiled_graphs"] is None or r["compiled_graphs"] >= 0
    # more images, more work in the full prefill (the vision tower is not rerun: entries cached)
    assert rows["full", 2]["aten_ops"] > rows["full", 1]["aten_ops"]
    table = [[c.strip() for c in re.split("[│┃]", line)[1:-1]] for line in output.splitlines()]
    header = next(cells for cells in table if "ops/layer" in cells)
    assert header[-2:] == ["ops/layer", "ops vs full"]  # no GPU, sync or eager-fall columns
    for (policy, n), r in rows.items():  # each row's ops/layer and "ops vs full" cells
        cells = next(c for c in table if c[:2] == [str(n), policy])
        ratio = r["aten_ops"] / rows["full", n]["aten_ops"]
        assert cells[-2:] == [f"{r['aten_ops_per_layer']:.0f}", f"{ratio:.2f}x"]
    # --top-ops on the CPU: the most frequent aten ops of every row
    assert output.count(f"top {TOP} aten ops by count:") == len(rows)
    assert f"mpic-4, 2 images ({rows['mpic-4', 2]['aten_ops']} ops)" in output


def test_engines_running_elsewhere_get_no_op_counts():
    class OutOfProcess:  # as the vLLM engine: no prefill_fn
        name = "elsewhere"

    fields = op_fields(OutOfProcess(), ["hello"], "mpic-4", top_ops=5)
    assert set(fields) == set(OP_FIELDS) and all(v is None for v in fields.values())


def test_gpu_sync_and_fall_columns_appear_when_rows_have_them(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # one line per row
    base = {
        "prompt_tokens": 10,
        "recomputed_tokens": 10,
        "ttft_ms": 2.0,
        "kl_vs_full": 0.0,
        "token_agreement": 1.0,
        "aten_ops": 400,
        "aten_ops_per_layer": 200.0,
    }
    full = {**base, "policy": "full", "images": 1, "eager_falls": 0, "compiled_graphs": 0}
    print_table([full])
    plain = capsys.readouterr().out
    assert "ops vs full" in plain and "GPU busy" not in plain and "syncs" not in plain
    assert "eager" not in plain
    gpu = {"gpu_busy_ms": 1.0, "gpu_busy_share": 0.25, "kernels": 77, "syncs": 5}
    mpic = {**base, **gpu, "policy": "mpic-4", "images": 1, "eager_falls": 3}
    mpic.update(aten_ops=100, aten_ops_per_layer=50.0)
    print_table([full, mpic])
    out = capsys.readouterr().out
    for col in ("GPU busy", "kernels", "syncs", "eager"):
        assert col in out
    row = next(line for line in out.splitlines() if "mpic-4" in line)
    cells = [c.strip() for c in re.split("[│┃]", row)[1:-1]]
    assert cells[-6:] == ["50", "0.25x", "25%", "77", "5", "3"]


@pytest.mark.parametrize(
    "bad",
    [
        ["--engine", "nope"],
        ["--policies", "full,bogus"],
        ["--images", "0"],
        ["--dtype", "int4"],
        ["--attention", "triton"],
        ["--device", "tpu"],
        ["--engine", "vllm", "--dtype", "bfloat16"],
        ["--top-ops", "-1"],
        ["--policies", "full,scout-0.2:l2-2"],  # the tiny model has layers 0-1
        ["--policies", "vlcache-0.5:0.5:0.5"],  # more ratios than layers
    ],
)
def test_bad_options_exit_2(tiny_llava_dir, bad):
    result = CliRunner().invoke(app, ["bench", "offline", "--model", str(tiny_llava_dir), *bad])
    assert result.exit_code == 2
    if bad[0] == "--policies" and ":" in bad[1]:
        assert "error:" in result.output and "layer" in result.output, result.output


def test_demo_on_a_given_model(tiny_llava_dir):
    result = CliRunner().invoke(
        app,
        [
            "demo",
            "--offline",
            "--model",
            str(tiny_llava_dir),
            "--policies",
            "full,mpic-4",
            "--repeats",
            "1",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "mpic-4" in result.output and "answers" in result.output


def test_the_bench_drives_any_engine():
    """The model-free fake engine through the same code (`mpic.benchmarks.offline.engines
    .Driver`): it echoes the prompt whatever the policy, so every policy agrees with full."""
    from mpic.benchmarks.offline.bench import run_offline
    from mpic.deployments.engines.fake_engine import FakeEngine

    rows = run_offline(FakeEngine("fake-bench"), [1, 2], ["full", "mpic-4"], repeats=1)
    assert [(r["policy"], r["images"]) for r in rows] == [
        ("full", 1),
        ("mpic-4", 1),
        ("full", 2),
        ("mpic-4", 2),
    ]
    for r in rows:
        assert set(r) == KEYS
        assert r["kl_vs_full"] < 1e-9 and r["token_agreement"] == 1.0
        assert 0 < r["recomputed_tokens"] < r["prompt_tokens"]  # its images are cached
        assert r["ttft_ms"] > 0 and r["cpu_ms"] >= 0
        assert r["floor_ms"] is None and r["aten_ops"] is None  # no optional hooks
