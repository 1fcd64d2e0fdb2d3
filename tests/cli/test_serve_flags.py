"""`mpic serve MODEL` with vLLM's flags (no Ray started: `start_local` is replaced by a recorder):
`--help` groups the flags as vLLM does, each flag lands in the config the application is built
from (over `--config`), the family comes from the checkpoint's config.json, API keys reach the
replicas' environment, and an unknown or conflicting flag exits with status 2 and says why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mpic.cli import app


@pytest.fixture
def started(monkeypatch):
    """Records what `mpic serve` would start, then stops it as Ctrl-C would."""
    import mpic.deployments.local as local

    seen: dict = {}

    def fake_start(cfg, **kw):
        seen.update(cfg=cfg, **kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(local, "start_local", fake_start)
    monkeypatch.setattr(local, "stop_local", lambda *a, **k: None)
    monkeypatch.delenv("MPIC_API_KEYS", raising=False)
    return seen


def serve(*args: str):
    return CliRunner().invoke(app, ["serve", *args], env={"COLUMNS": "160"})


def test_help_groups_flags_as_vllm() -> None:
    out = serve("--help").output
    for panel in ("Frontend", "ModelConfig", "CacheConfig", "ParallelConfig", "SchedulerConfig"):
        assert panel in out
    for flag in (
        "--served-model-name", "--max-model-len", "--gpu-memory-utilization",
        "--tensor-parallel-size", "--dtype", "--api-key", "--chat-template", "--block-size",
        "--max-num-seqs", "--host", "--port", "--config", "--max-num-batched-tokens",
        "--enable-prefix-caching", "--no-enable-prefix-caching", "--enforce-eager",
        "--no-enforce-eager", "--seed",
    ):  # fmt: skip
        assert flag in out, flag


def test_flags_reach_the_config(started, tiny_qwen2vl_dir: Path, tmp_path: Path) -> None:
    import os

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    res = serve(
        str(tiny_qwen2vl_dir),
        "--served-model-name", "qwen",
        "--max-model-len", "2k",
        "--api-key", "k1,k2",
        "--api-key", "k3",
        "--port", "8123",
        "--host", "0.0.0.0",
        "--dtype", "float",
        "--gpu-memory-utilization", "0.5",
        "-tp", "1",
        "--block-size", "64",
        "--max-num-seqs", "4",
        "--chat-template", str(template),
        "--max-num-batched-tokens", "1024",
        "--no-enable-prefix-caching",
        "--no-enforce-eager",
        "--seed", "7",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    cfg = started["cfg"]
    e = cfg.engine
    assert (e.kind, e.model, e.family, e.served_names) == (
        "vllm",
        str(tiny_qwen2vl_dir),
        "qwen2-vl",
        ["qwen"],
    )
    assert (e.max_model_len, e.dtype, e.gpu_memory_utilization) == (2000, "float32", 0.5)
    assert (e.tensor_parallel_size, e.block_size, e.max_num_seqs) == (1, 64, 4)
    assert e.chat_template == str(template)
    assert (e.max_num_batched_tokens, e.enable_prefix_caching, e.enforce_eager, e.seed) == (
        1024,
        False,
        False,
        7,
    )
    assert (started["host"], started["port"]) == ("0.0.0.0", 8123)
    assert cfg.auth.mode == "production"  # the dev keys are off
    assert json.loads(os.environ["MPIC_API_KEYS"]) == {k: "default" for k in ("k1", "k2", "k3")}


def test_model_name_defaults_to_the_argument(started, tiny_qwen2vl_dir: Path) -> None:
    assert serve(str(tiny_qwen2vl_dir)).exit_code == 0
    assert started["cfg"].engine.served_names == [str(tiny_qwen2vl_dir)]
    assert started["cfg"].auth.mode == "dev"  # no --api-key: the embedded default's keys


def test_flags_override_the_config(started, tiny_llava_dir: Path, tmp_path: Path) -> None:
    conf = tmp_path / "c.yaml"
    conf.write_text(
        f"engine: {{kind: vllm, model: {tiny_llava_dir}, max_num_seqs: 8, "
        "served_model_name: a}\nauth: {mode: production}\n"
    )
    assert serve("--config", str(conf), "--max-num-seqs", "2").exit_code == 0
    e = started["cfg"].engine
    assert (e.max_num_seqs, e.served_names, e.model) == (2, ["a"], str(tiny_llava_dir))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bogus"], "No such option"),
        (["--block-size", "48"], "multiple of 32"),
        (["--dtype", "int3"], "--dtype 'int3'"),
        (["--max-model-len", "lots"], "--max-model-len 'lots'"),
        (["--max-model-len", "1000000"], "longer than the model's context"),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
        (["--seed", "x"], "--seed"),
    ],
)
def test_bad_flags_exit_2(started, tiny_llava_dir: Path, args, message) -> None:
    res = serve(str(tiny_llava_dir), *args)
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert "cfg" not in started  # nothing was started


def test_vllm_only_flag_with_the_reference_engine_exits_2(started, tmp_path: Path) -> None:
    conf = tmp_path / "c.yaml"
    conf.write_text("engine: {kind: reference, model: /m}\n")
    res = serve("--config", str(conf), "--tensor-parallel-size", "2", "--max-num-seqs", "3")
    assert res.exit_code == 2
    assert "--tensor-parallel-size, --max-num-seqs: only the vllm engine" in res.output
    res = serve("--config", str(conf), "--no-enable-prefix-caching", "--seed", "1")
    assert res.exit_code == 2
    assert "--enable-prefix-caching, --seed: only the vllm engine" in res.output


def test_a_folder_without_a_model_exits_2(started, tmp_path: Path) -> None:
    res = serve(str(tmp_path))
    assert res.exit_code == 2 and "no config.json" in res.output


def test_no_arguments_is_the_embedded_default(started) -> None:
    from mpic.deployments.config import load_config

    assert serve().exit_code == 0
    assert started["cfg"] == load_config(None)  # vllm engine, dev keys, small random LLaVA
    assert started["cfg"].engine.kind == "vllm" and started["port"] == 8000
