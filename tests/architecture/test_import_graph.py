"""The package floors hold: no upward import, no cycle, vllm only under engine/vllm/."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _checker():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts/import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_upward_imports_cycles_or_stray_vllm() -> None:
    assert _checker().violations() == []


def test_cycle_finder_reports_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _checker()._cycles(graph) == [["a", "b", "c"]]


def test_every_project_module_is_on_a_floor() -> None:
    names = dict(_checker().modules())
    assert "mpic.linker.contracts" in names and "mpic.engine.vllm.connector" in names
    assert len(names) > 90
