"""`mpic bench offline` and `mpic demo` end to end on the tiny LLaVA: JSON shape, exactness of
policies that recompute everything, plot written, bad options rejected with exit code 2."""

import json

import pytest
from typer.testing import CliRunner

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
}


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
    ]
    result = CliRunner().invoke(app, args)
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
    ],
)
def test_bad_options_exit_2(tiny_llava_dir, bad):
    result = CliRunner().invoke(app, ["bench", "offline", "--model", str(tiny_llava_dir), *bad])
    assert result.exit_code == 2


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
