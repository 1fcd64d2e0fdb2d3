"""`mpic bench compress` on the tiny LLaVA: JSON shape, the memory figures against the exact
byte count of the compressed KV, fidelity columns, bad options exit 2; every reference run goes
through the `Engine` protocol (`ReferenceEngine.decode`, the press and the teacher forcing in its
`GenerateRequest`); the uniform-across-layers selection (the vLLM path's variant) keeps one token
set of exactly the budget."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from mpic.cli import app
from mpic.presses.base import keep_count


@pytest.fixture(scope="module")
def bench(tiny_llava_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("compress")
    args = [
        "bench", "compress", "--model", str(tiny_llava_dir), "--presses", "window,meda",
        "--budgets", "1,0.5", "--images", "2", "--prompts", "1", "--steps", "4",
        "--json", str(out / "c.json"), "--plot", str(out / "c.png"),
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return result.output, json.loads((out / "c.json").read_text()), out


def test_json_table_and_plot(bench, tiny_llava_dir):
    output, doc, out = bench
    assert doc["engine"] == "reference" and doc["model"] == str(tiny_llava_dir)
    rows = {(r["press"], r["budget"]): r for r in doc["results"]}
    assert set(rows) == {("none", 1.0), ("window", 0.5), ("meda", 0.5)}
    none = rows[("none", 1.0)]
    assert none["kl_mean"] == 0 and none["token_agreement"] == 1
    # exact bytes: K and V, L layers, (kept + decoded) entries, H_kv heads, D, float32
    cfg = json.loads((tiny_llava_dir / "config.json").read_text())["text_config"]
    L, h_kv = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    n = int(none["prompt_tokens"])
    assert none["kv_bytes"] == 2 * L * (n + 4) * h_kv * d * 4
    for press in ("window", "meda"):
        r = rows[(press, 0.5)]
        assert r["kv_bytes"] == 2 * L * (keep_count(0.5, n) + 4) * h_kv * d * 4
        assert r["kv_bytes_full"] == none["kv_bytes"]
        assert r["kl_mean"] >= 0 and 0 <= r["token_agreement"] <= 1
    assert "| window | 0.5 |" in output
    assert (out / "c.png").stat().st_size > 0


def test_reference_runs_go_through_the_engine_protocol(tiny_llava_dir, monkeypatch):
    from mpic.engine.hf.engine import ReferenceEngine

    seen = []
    decode = ReferenceEngine.decode

    def spy(self, request):  # noqa: ANN001, ANN202
        seen.append(request)
        return decode(self, request)

    monkeypatch.setattr(ReferenceEngine, "decode", spy)
    args = [
        "bench", "compress", "--model", str(tiny_llava_dir), "--presses", "window",
        "--budgets", "1,0.5", "--images", "1", "--prompts", "2", "--steps", "3",
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    # per prompt: the reference run, then the press run teacher-forced on its tokens and free
    assert [(r.press, r.budget, len(r.forced_ids)) for r in seen] == [
        (None, None, 0),
        (None, None, 0),
        *[("window", 0.5, 3), ("window", 0.5, 0)] * 2,
    ]
    assert all(r.capture_steps and not r.plain and r.max_tokens == 3 for r in seen)


@pytest.mark.parametrize(
    "bad",
    [
        ["--presses", "h2o"],
        ["--budgets", "0"],
        ["--budgets", "1.5"],
        ["--engine", "tgi"],
        ["--policy", "nope"],
        ["--items", "video"],
    ],
)
def test_bad_options_exit_2(tiny_llava_dir, bad):
    result = CliRunner().invoke(app, ["bench", "compress", "--model", str(tiny_llava_dir), *bad])
    assert result.exit_code == 2, result.output


def test_vllm_refuses_mrope_models_exit_2(tiny_qwen2vl_dir):
    # vLLM derives an image's tokens from its M-RoPE grid: no compressed images (no engine starts)
    args = ["bench", "compress", "--model", str(tiny_qwen2vl_dir), "--engine", "vllm"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "M-RoPE" in result.output, result.output


def test_uniform_keep_is_one_set_of_the_budget(tiny_llava_dir):
    from mpic.engine.hf.compress import observed, observer_for
    from mpic.engine.hf.reference_runner import ReferenceRunner
    from mpic.linker.kv.dense import DenseLinkedKV
    from mpic.linker.pipeline import link_and_prefill
    from mpic.linker.positions import next_position
    from mpic.presses.base import PressContext
    from mpic.presses.registry import PRESSES, get_press
    from mpic.samples import interleaved_prompt, synthetic_png

    r = ReferenceRunner(str(tiny_llava_dir))
    parts = interleaved_prompt([r.cache_image(synthetic_png(i)).entry_id for i in range(2)])
    planned = r.plan(parts, "mpic-4")
    a, plan = r.adapter, planned.plan
    kv = DenseLinkedKV(a.num_layers, plan.num_tokens, a.num_kv_heads, a.head_dim)
    obs = observer_for(plan, a)
    with torch.inference_mode():
        oa, okv = observed(a, kv, obs)
        link_and_prefill(oa, planned, okv)
    n = plan.num_tokens
    keys = [kv.keys[layer, :n].transpose(0, 1) for layer in range(a.num_layers)]
    ctx = PressContext(n, plan.source_entry >= 0, next_position(plan.positions), False, a)
    for name in PRESSES:
        with torch.inference_mode():
            idx = get_press(name).uniform_keep(keys, keys, obs.layers, ctx, 0.3)
        assert idx.shape == (keep_count(0.3, n),)
        assert bool((idx[1:] > idx[:-1]).all())  # ascending, unique
        assert int(idx[-1]) == n - 1  # every press keeps the last prompt token
    win = get_press("window").uniform_keep(keys, keys, obs.layers, ctx, 0.3)
    c = keep_count(0.3, n)
    assert win.tolist() == list(range(4)) + list(range(n - (c - 4), n))
