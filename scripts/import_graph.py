"""Check the import graph of the project's packages (CLI and test, no project imports).

Floors, lowest first: a module may import its own package and any package on a lower floor,
never one on its own floor or above. `vllm` is imported only under engine/vllm/. No import
circle between modules at any depth: every executed import statement counts, at module level or
inside a function (a function-level import that closes a circle only hides it until the function
runs); imports under `if TYPE_CHECKING:` never run and count for the floors only.

Run: python scripts/import_graph.py  (exit 1 and the violations and circles if any)
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
# Inside engine/: the random-model writer sits below the two backends, which sit beside each
# other (neither imports the other: what both need lives in engine/ itself); the modules
# directly in engine/ (the engine protocol, the request flow, items: what both backends share)
# sit below both (the last, catch-all prefix: a subpackage listed earlier matches first).
SUBFLOORS: dict[str, int] = {
    "mpic.engine.tiny": 0,
    "mpic.engine.hf": 1,
    "mpic.engine.vllm": 1,
    "mpic.engine": 0,
}


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


def imports(path: Path, *, typing_only: bool = True) -> Iterator[tuple[str, bool]]:
    """(imported module, at module level) for each import statement of the file, at any depth;
    without `typing_only`, leaves out those under `if TYPE_CHECKING:` (never executed)."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    skip = set() if typing_only else _typing_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, id(node) in top
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                yield f"{node.module}.{alias.name}", id(node) in top
                yield node.module, id(node) in top


def _typing_only(tree: ast.AST) -> set[int]:
    """ids of the nodes inside `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`) bodies."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def violations() -> list[str]:
    """Every floor or vllm rule broken, as readable lines (circles: `circles()`)."""
    found: list[str] = []
    names = dict(modules())
    for module, path in names.items():
        own = package_of(module)
        for target, _ in imports(path):
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
    return found


def graph(*, module_level_only: bool = False) -> dict[str, set[str]]:
    """module -> project modules it imports (module and function level unless asked otherwise;
    `if TYPE_CHECKING:` imports included: a type-only circle is still a circle to a reader)."""
    names = dict(modules())
    edges: dict[str, set[str]] = {m: set() for m in names}
    for module, path in names.items():
        for target, top_level in imports(path):
            if target in names and target != module and (top_level or not module_level_only):
                edges[module].add(target)
    return edges


def circles() -> list[list[str]]:
    """The import circles counting imports at every depth (TYPE_CHECKING ones too), one per
    strongly connected component of more than one module (its modules, sorted)."""
    return _cycles(graph())


def package_of_module(module: str, path: Path) -> str:
    """The package (folder) a module lives in: itself for a package's `__init__`."""
    return module if path.name == "__init__.py" else module.rsplit(".", 1)[0]


def package_circles() -> list[list[str]]:
    """Circles between packages at any depth (`mpic.deployments.http` <-> `.serve`): the
    module graph collapsed to folders, an import between a package and its own parent or child
    left out (a room may use its building's shared modules and vice versa)."""
    names = dict(modules())
    edges: dict[str, set[str]] = {}
    for module, targets in graph().items():
        a = package_of_module(module, names[module])
        edges.setdefault(a, set())
        for target in targets:
            b = package_of_module(target, names[target])
            edges.setdefault(b, set())
            if a != b and not a.startswith(b + ".") and not b.startswith(a + "."):
                edges[a].add(b)
    return _cycles(edges)


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
    rings = circles()
    rooms = package_circles()
    for line in found:
        print(line)
    for ring in rings:
        print(f"import circle: {' <-> '.join(ring)}")
    for ring in rooms:
        print(f"package circle: {' <-> '.join(ring)}")
    print(
        f"{len(found)} violation(s), {len(rings)} circle(s), {len(rooms)} package circle(s) "
        "(function-level and TYPE_CHECKING imports counted)"
    )
    return 1 if found or rings or rooms else 0


if __name__ == "__main__":
    sys.exit(main())
