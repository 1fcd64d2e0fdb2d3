"""Check the import graph of the project's packages (CLI and test, no project imports).

Floors, lowest first: a module may import its own package and any package on a lower floor,
never one on its own floor or above. `vllm` is imported only under engine/vllm/. No import cycle
between modules (module-level imports; a function-level import still counts for the floors).

Run: python scripts/import_graph.py  (exit 1 and a list of violations if any)
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# package -> (folder, floor). `mpic` is the core: shared types, errors, config, model spec.
PACKAGES: dict[str, tuple[str, int]] = {
    "mpic": ("mpic", 0),
    "mpic.kernels": ("kernels", 1),
    "mpic.linker": ("linker", 2),
    "mpic.storage": ("storage", 2),
    "mpic.presses": ("presses", 2),
    "mpic.retriever": ("retriever", 3),
    "mpic.engine": ("engine", 4),
    "mpic.deployments": ("deployments", 5),
    "mpic.benchmarks": ("benchmarks", 6),
    "mpic.cli": ("cli", 7),
}
# Inside engine/: the random-model writer and the HF engine sit below the vLLM engine.
SUBFLOORS: dict[str, int] = {"mpic.engine.tiny": 0, "mpic.engine.hf": 1, "mpic.engine.vllm": 2}


def modules() -> Iterator[tuple[str, Path]]:
    """(dotted module name, file) for every project module."""
    for package, (folder, _) in PACKAGES.items():
        base = ROOT / folder
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            yield ".".join([package, *parts]), path


def package_of(module: str) -> str:
    """The longest known package prefix of `module`."""
    best = "mpic"
    for package in PACKAGES:
        if module == package or module.startswith(package + "."):
            if len(package) > len(best):
                best = package
    return best


def imports(path: Path) -> Iterator[tuple[str, bool]]:
    """(imported module, at module level) for each import statement of the file."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, id(node) in top
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                yield f"{node.module}.{alias.name}", id(node) in top
                yield node.module, id(node) in top


def violations() -> list[str]:
    """Every rule broken, as readable lines."""
    found: list[str] = []
    names = dict(modules())
    graph: dict[str, set[str]] = {m: set() for m in names}
    for module, path in names.items():
        own = package_of(module)
        for target, top_level in imports(path):
            if target.split(".")[0] == "vllm" and not module.startswith("mpic.engine.vllm"):
                found.append(f"{module}: imports {target} outside engine/vllm/")
            if not target.startswith("mpic.") and target != "mpic":
                continue
            if target not in names:
                continue  # `from pkg import name` also yields pkg.name: keep real modules only
            other = package_of(target)
            if other != own and PACKAGES[other][1] >= PACKAGES[own][1]:
                floors = f"floor {PACKAGES[other][1]} >= {PACKAGES[own][1]}"
                found.append(f"{module}: imports {target} ({floors})")
            sub, sub_other = _sub(module), _sub(target)
            if sub and sub_other and sub != sub_other and SUBFLOORS[sub_other] >= SUBFLOORS[sub]:
                found.append(f"{module}: imports {target} (engine subpackage above or beside)")
            if top_level and target != module:
                graph[module].add(target)
    found += [f"import cycle: {' -> '.join(c)}" for c in _cycles(graph)]
    return found


def _sub(module: str) -> str | None:
    return next((s for s in SUBFLOORS if module == s or module.startswith(s + ".")), None)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def main() -> int:
    found = violations()
    for line in found:
        print(line)
    print(f"{len(found)} violation(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
