"""What the project defines, read from its sources: modules, their top-level names, classes and
their members, the words its code spells; plus the commands and options of its CLI (typer
introspection) and the serving config's sections. Nothing else of the project is imported, except
as the last resort for a class member that only a third-party base class has. For the docs' name
check (`tests/architecture/doc_names.py`).
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _import_graph():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts/import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PACKAGE_FOLDERS = {package: folder for package, (folder, _) in _import_graph().PACKAGES.items()}
"""Import package -> its folder (`mpic.linker` -> `linker`)."""


@dataclass
class ClassInfo:
    module: str
    members: set[str] = field(default_factory=set)
    bases: list[str] = field(default_factory=list)


@dataclass
class Index:
    modules: dict[str, Path] = field(default_factory=dict)
    """Dotted project module (packages, tests, scripts) -> file."""
    names: dict[str, dict[str, str]] = field(default_factory=dict)
    """Module -> its top-level names: "class", "def", "var" or "import:<dotted origin>"."""
    classes: dict[str, list[ClassInfo]] = field(default_factory=dict)
    functions: set[str] = field(default_factory=set)
    """Every function and method name."""
    words: set[str] = field(default_factory=set)
    """Identifiers used in code (module names included) and string literals that are exactly
    an identifier (metric names, JSON keys)."""
    foreign_modules: set[str] = field(default_factory=set)
    """Names third-party imports bind (`vllm`, `serve` from `from ray import serve`)."""
    bound: set[str] = field(default_factory=set)
    """Names bound as variables, parameters or third-party imports somewhere (`spec`, `app`)."""
    files: list[str] = field(default_factory=list)
    """Repo-relative paths of every project .py file."""
    env: set[str] = field(default_factory=set)
    """ALL_CAPS words of the shell scripts, Dockerfile and manifests (environment variables)."""

    def short(self, name: str) -> list[str]:
        return [m for m in self.modules if m.rsplit(".", 1)[-1] == name]

    def defines(self, name: str) -> bool:
        """A top-level name of some module (class, function, variable or import)."""
        return name in self.classes or any(name in names for names in self.names.values())


def _module_names() -> Iterator[tuple[str, Path]]:
    """(dotted name, file) of the packages', tests' and scripts' modules; tests/architecture/
    is left out (its strings are the names it checks)."""
    for package, folder in PACKAGE_FOLDERS.items():
        base = ROOT / folder
        for file in sorted(base.rglob("*.py")):
            rel = file.relative_to(base).with_suffix("")
            yield ".".join([package, *(p for p in rel.parts if p != "__init__")]), file
    for folder in ("tests", "scripts"):
        for file in sorted((ROOT / folder).rglob("*.py")):
            if file.parent == ROOT / "tests" / "architecture":
                continue
            rel = file.relative_to(ROOT).with_suffix("")
            yield ".".join(p for p in rel.parts if p != "__init__"), file


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements at module (or class) level, inside if/try/with blocks too."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _top_level(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            inner = node.body + node.orelse + node.finalbody
            yield from _top_level(inner + [s for h in node.handlers for s in h.body])
        elif isinstance(node, ast.With):
            yield from _top_level(node.body)


def _targets(node: ast.stmt) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        out = []
        for t in node.targets:
            out.extend(t.elts if isinstance(t, ast.Tuple) else [t])
        return out
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [node.target]
    return []


def _class_info(module: str, node: ast.ClassDef) -> ClassInfo:
    info = ClassInfo(module)
    for base in node.bases:
        expr = base.value if isinstance(base, ast.Subscript) else base
        info.bases.append(ast.unparse(expr).rsplit(".", 1)[-1])
    for stmt in _top_level(node.body):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            info.members.add(stmt.name)
        info.members.update(t.id for t in _targets(stmt) if isinstance(t, ast.Name))
    for sub in ast.walk(node):
        for t in _targets(sub) if isinstance(sub, ast.stmt) else ():
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name):
                if t.value.id in ("self", "cls"):
                    info.members.add(t.attr)
    return info


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@functools.lru_cache(maxsize=1)
def code_index() -> Index:
    """The project's names from its sources (nothing imported)."""
    index = Index()
    shell = [
        *ROOT.glob("scripts/**/*.sh"),
        ROOT / "run",
        ROOT / "Dockerfile",
        *ROOT.glob("k8s/**/*"),
    ]
    for path in shell:
        if path.is_file():
            index.env.update(
                re.findall(r"\b[A-Z][A-Z0-9_]{2,}\b", path.read_text(errors="replace"))
            )
    for module, path in _module_names():
        index.modules[module] = path
        index.files.append(str(path.relative_to(ROOT)))
        index.words.add(path.stem)
        tree = ast.parse(path.read_text(), str(path))
        names: dict[str, str] = {}
        for node in _top_level(tree.body):
            if isinstance(node, ast.ClassDef):
                names[node.name] = "class"
                index.classes.setdefault(node.name, []).append(_class_info(module, node))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names[node.name] = "def"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    names[a.asname or a.name.split(".")[0]] = f"import:{a.name}"
            elif isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    names[a.asname or a.name] = f"import:{node.module}.{a.name}"
            for t in _targets(node):
                if isinstance(t, ast.Name):
                    names[t.id] = "var"
        index.names[module] = names
        docstrings = {
            id(n.value)
            for n in ast.walk(tree)
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
        }
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                index.functions.add(n.name)
                index.words.add(n.name)
            elif isinstance(n, ast.ClassDef):
                index.words.add(n.name)
            elif isinstance(n, ast.Name):
                index.words.add(n.id)
                if isinstance(n.ctx, ast.Store):
                    index.bound.add(n.id)
            elif isinstance(n, ast.Attribute):
                index.words.add(n.attr)
            elif isinstance(n, ast.arg):
                index.words.add(n.arg)
                index.bound.add(n.arg)
            elif isinstance(n, ast.keyword) and n.arg:
                index.words.add(n.arg)
            elif isinstance(n, ast.alias):
                index.words.update((n.asname or n.name).split("."))
                index.words.update(n.name.split("."))
            if isinstance(n, ast.Import):
                for a in n.names:
                    if not a.name.startswith("mpic"):
                        index.bound.add(a.asname or a.name.split(".")[0])
                        index.foreign_modules.add(a.asname or a.name.split(".")[0])
            elif isinstance(n, ast.ImportFrom) and n.level == 0:
                if not (n.module or "").startswith("mpic"):
                    index.bound.update(a.asname or a.name for a in n.names)
                    index.foreign_modules.update(a.asname or a.name for a in n.names)
                    index.foreign_modules.add((n.module or "").split(".")[0])
            elif isinstance(n, ast.Constant) and isinstance(n.value, str):
                if id(n) not in docstrings and _IDENT.fullmatch(n.value):
                    index.words.add(n.value)
    return index


def class_has(index: Index, cls: str, member: str, seen: frozenset[str] = frozenset()) -> bool:
    """`member` of the project class `cls` or of its bases (third-party bases by import)."""
    for info in index.classes.get(cls, []):
        if member in info.members:
            return True
        for base in info.bases:
            if base in seen or base == cls:
                continue
            if base in index.classes:
                if class_has(index, base, member, seen | {cls}):
                    return True
            elif runtime_has(info.module, cls, member):
                return True
    return False


@functools.cache
def runtime_has(module: str, *attrs: str) -> bool:
    """`module.attrs[0].attrs[1]...` by importing (the fallback for what sources do not show)."""
    try:
        obj = importlib.import_module(module)
        for attr in attrs:
            obj = getattr(obj, attr)
    except Exception:  # noqa: BLE001 (any failure: not there)
        return False
    return True


def resolve_dotted(parts: list[str]) -> str | None:
    """None when `mpic.a.b.c` resolves; else why not."""
    index = code_index()
    for k in range(len(parts), 0, -1):
        module = ".".join(parts[:k])
        if module in index.modules:
            return resolve_in(module, parts[k:])
    return "no such module"


def resolve_in(module: str, rest: list[str], depth: int = 0) -> str | None:
    index = code_index()
    if not rest or depth > 8:
        return None
    name, more = rest[0], rest[1:]
    kind = index.names[module].get(name)
    if kind is None:
        dynamic = "__getattr__" in index.names[module] or "*" in index.names[module]
        if dynamic and runtime_has(module, *rest[:2]):
            return None  # a module-level __getattr__ or star import: ask the module
        return f"{module} defines no {name!r}"
    if kind == "class":
        if not more or class_has(index, name, more[0]):
            return None
        return f"class {name} has no member {more[0]!r}"
    if kind.startswith("import:mpic."):
        origin = kind.removeprefix("import:").split(".")
        target = ".".join(origin)
        if target in index.modules:
            return resolve_in(target, more, depth + 1)
        return resolve_in(".".join(origin[:-1]), [origin[-1], *more], depth + 1)
    return None  # a function, a variable or a third-party import: deeper attributes unchecked


@functools.lru_cache(maxsize=1)
def config_sections() -> frozenset[str]:
    """Top-level keys of the serving config (dotted config keys start with one)."""
    from mpic.deployments.config import ServeAppConfig

    return frozenset(ServeAppConfig.model_fields)


@functools.lru_cache(maxsize=1)
def cli_commands() -> dict[tuple[str, ...], frozenset[str]]:
    """(command path) -> its long options, for `mpic` and `mpic-admin` (typer introspection)."""
    import typer.main

    from mpic.cli import app
    from mpic.cli.admin import app as admin_app

    out: dict[tuple[str, ...], frozenset[str]] = {}

    def walk(cmd, path: tuple[str, ...]) -> None:  # noqa: ANN001
        opts = {"--help"}
        for param in cmd.params:
            opts.update(o for o in [*param.opts, *param.secondary_opts] if o.startswith("--"))
        out[path] = frozenset(opts)
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, (*path, name))

    walk(typer.main.get_command(app), ("mpic",))
    walk(typer.main.get_command(admin_app), ("mpic-admin",))
    return out


def all_flags() -> frozenset[str]:
    return frozenset().union(*cli_commands().values())
