"""The package floors hold: no upward import, no import circle at any depth (function-level and
TYPE_CHECKING imports counted), between modules or between packages at any depth (rooms such as
deployments/http and deployments/serve), vllm only under engine/vllm/."""

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


def test_no_import_circles_at_any_depth() -> None:
    assert _checker().circles() == []


def test_no_circles_between_packages_at_any_depth() -> None:
    assert _checker().package_circles() == []


def test_package_circles_are_found(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    # two rooms of one building importing each other (one import type-only) form a circle; a
    # room importing its building's module does not
    checker = _checker()
    root = tmp_path / "pkg"
    for room in ("http", "serve"):
        (root / room).mkdir(parents=True)
        (root / room / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "messages.py").write_text("")
    (root / "http" / "ingress.py").write_text(
        "import mpic.pkg.serve.files\nimport mpic.pkg.messages\n"
    )
    (root / "serve" / "files.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import mpic.pkg.http.ingress\n"
    )
    monkeypatch.setattr(checker, "PACKAGES", {"mpic.pkg": ("pkg", 0)})
    monkeypatch.setattr(checker, "ROOT", tmp_path)
    assert checker.package_circles() == [["mpic.pkg.http", "mpic.pkg.serve"]]


def test_function_level_imports_are_read(tmp_path) -> None:  # noqa: ANN001
    source = tmp_path / "m.py"
    source.write_text(
        "import a\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import b\n"
        "def f():\n    from c import d\n"
    )
    found = set(_checker().imports(source))
    assert {("a", True), ("b", False), ("c.d", False), ("c", False)} <= found
    run = set(_checker().imports(source, typing_only=False))
    assert ("c.d", False) in run and ("b", False) not in run


def test_cycle_finder_reports_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _checker()._cycles(graph) == [["a", "b", "c"]]


def test_every_project_module_is_on_a_floor() -> None:
    names = dict(_checker().modules())
    assert "mpic.linker.contracts" in names and "mpic.engine.vllm.connector.kv_connector" in names
    assert len(names) > 90
