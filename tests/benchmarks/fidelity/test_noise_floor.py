"""The noise floor of `mpic bench fidelity` (benchmarks/fidelity/noise_floor.py) on the tiny random
LLaVA: full prefill in bfloat16 and with the other attention backend, scored against float32 full
like a policy, gives a row each with sane values (a float32 backend change drifts by float32
reassociation only, bfloat16 by more but far less than an approximate policy), in the task rows,
the table, the JSON and the PNG; bad floors exit 2. The floors are the reference engine's
`variant`s (an optional `Engine` member); an engine without one is refused."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mpic.benchmarks.fidelity.bench import ROW_KEYS, run_fidelity
from mpic.benchmarks.fidelity.noise_floor import NOISE_FLOORS, floor_label, make_floor, parse_floors
from mpic.benchmarks.fidelity.prompts import passages
from mpic.benchmarks.fidelity.report import print_table
from mpic.benchmarks.fidelity.task import run_task

FLOORS = ("bf16", "flex")


@pytest.fixture(scope="module")
def engine(tiny_llava_dir, monkeypatch_module):
    from mpic.engine.hf.engine import ReferenceEngine

    return ReferenceEngine.load(str(tiny_llava_dir))


@pytest.fixture(scope="module")
def monkeypatch_module():
    """The reference's attention backend is the CPU default (`sdpa_runs`) whatever the
    environment says."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MPIC_ATTENTION_BACKEND", raising=False)
        yield mp


@pytest.fixture(scope="module")
def floors(engine, tiny_llava_dir):
    return [make_floor(engine, str(tiny_llava_dir), name) for name in FLOORS]


def test_floor_names_parse_and_the_reference_itself_is_refused(engine, tiny_llava_dir):
    assert parse_floors("bf16, flex,bf16") == ["bf16", "flex"]
    assert parse_floors("none") == [] and parse_floors("") == []
    assert set(NOISE_FLOORS) == {"bf16", "fp16", "flex", "sdpa_runs"}
    with pytest.raises(ValueError, match="fp8"):
        parse_floors("bf16,fp8")
    # bit-identical to the reference (float32, sdpa_runs on CPU): a floor of 0 means nothing
    with pytest.raises(ValueError, match="bit-identical"):
        make_floor(engine, str(tiny_llava_dir), "sdpa_runs")
    with pytest.raises(ValueError, match="already runs in"):
        engine.variant(str(tiny_llava_dir), dtype="float32")
    assert floor_label("bf16") == "noise-floor (bf16 full)"


def test_an_engine_without_variant_has_no_floor(engine, tiny_llava_dir):
    class NoVariant:  # an `Engine` that cannot compute another way (e.g. vLLM)
        spec, processor = engine.spec, engine.processor
        decode = engine.decode

    with pytest.raises(ValueError, match="no variant"):
        make_floor(NoVariant(), str(tiny_llava_dir), "flex")
    with pytest.raises(ValueError, match="unknown noise floor"):
        make_floor(NoVariant(), str(tiny_llava_dir), "fp8")


def test_floor_rows_have_sane_values(engine, floors):
    policies = ["full", "mpic-4", "full-reuse"]
    rows = run_fidelity(engine, [2], policies, 2, items="images", floors=floors)
    labels = [floor_label(n) for n in FLOORS]
    assert [r["policy"] for r in rows] == ["full", *labels, "mpic-4", "full-reuse"]
    by = {r["policy"]: r for r in rows}
    for r in rows:
        assert set(ROW_KEYS) <= set(r)
        assert 0 <= r["agreement_32"] <= 1 and 0 <= r["rouge_l"] <= 1
        assert 0 <= r["exact_prefix"] <= 32 and r["kl_first"] >= 0
    bf16, flex = by[labels[0]], by[labels[1]]
    for floor, name in ((bf16, "bf16"), (flex, "flex")):
        assert floor["noise_floor"] == name and floor["kl_over_floor"] is None
        assert (
            floor["recomputed_fraction"] == 1.0
            and floor["prompt_tokens"] == by["full"]["prompt_tokens"]
        )
    # float32 with another attention backend: bit-different, only reassociation noise
    assert 0 < flex["kl_first"] < 1e-6
    # bfloat16: nonzero, small against what the items do and against every approximate policy
    assert 0 < bf16["kl_first"] < 0.05 * bf16["kl_no_items"]
    assert bf16["kl_first"] < min(by[p]["kl_first"] for p in ("mpic-4", "full-reuse"))
    # every policy row: its KL in units of the first floor's (bf16)
    assert by["full"]["noise_floor"] is None and by["full"]["kl_over_floor"] == 0.0
    for p in ("mpic-4", "full-reuse"):
        assert by[p]["kl_over_floor"] == pytest.approx(by[p]["kl_first"] / bf16["kl_first"])
        assert by[p]["kl_over_floor"] > 1
    print_table(rows, "tiny")  # the KL / floor column renders


def test_task_rows_carry_the_floors(engine, floors):
    rows = run_task(engine, passages(2, 300), [2], ["full", "mpic-4"], 2, floors=floors)
    assert [r["policy"] for r in rows] == ["full", *(f.label for f in floors), "mpic-4"]
    for r in rows:
        assert 0 <= r["accuracy"] <= 1 and r["kl_first"] >= 0
    floor_rows = [r for r in rows if r["noise_floor"]]
    assert [r["noise_floor"] for r in floor_rows] == list(FLOORS)
    assert all(r["recomputed_fraction"] == 1.0 for r in floor_rows)
    assert 0 < floor_rows[0]["kl_first"] < rows[-1]["kl_first"]


def test_the_cli_writes_the_floor_to_json_and_png(tiny_llava_dir, tmp_path, monkeypatch_module):
    from mpic.cli import app

    out, png = tmp_path / "f.json", tmp_path / "f.png"
    base = ["bench", "fidelity", "--model", str(tiny_llava_dir), "--items", "images"]
    args = [*base, "--documents", "2", "--questions", "1", "--policies", "full,full-reuse"]
    res = CliRunner().invoke(
        app, [*args, "--noise-floor", "bf16", "--json", str(out), "--plot", str(png)]
    )
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())["results"]
    assert [r["policy"] for r in rows] == ["full", "noise-floor (bf16 full)", "full-reuse"]
    assert rows[1]["noise_floor"] == "bf16" and rows[1]["kl_first"] > 0
    # nothing recomputed is far beyond the floor (mpic-4, with the lead-in, is within it here)
    assert rows[2]["kl_over_floor"] > 1 and png.stat().st_size > 0
    assert "KL / floor" in res.output
    for bad in ("fp8", "sdpa_runs"):
        res = CliRunner().invoke(app, [*args, "--noise-floor", bad])
        assert res.exit_code == 2, res.output
