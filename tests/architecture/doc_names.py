"""Which names the docs give in backticks, and whether each exists (docs/*.md, README.md and
CONTRIBUTING.md; `test_doc_names.py` runs it, `python -m tests.architecture.doc_names` prints
what it finds).

A backticked span is a name when it has one of the forms below. Everything else is prose, a
value or third-party syntax and is left alone: spans with spaces that are none of these forms
(shell commands, formulas, JSON, YAML), spans with `=`, a `<placeholder>` or `://`, single
lower-case words (`full`, `prefix`: values and policy names share the form), metric names with
labels, file names other than `.py`, paths outside the project's folders (`.mpic/...`).

- A repo path whose first folder is a project folder (`PATH_ROOTS`: `linker/recipe.py`,
  `engine/hf/`, `docs/bench_storage.png`, `linker/policies/*.py`) exists (a glob matches);
  with `path.py:name`, `path.py::test_name` or `engine/tiny/configs.NAME` the file defines the
  name. A bare `.py` path (`request_flow.py`, `policies/base.py`) is the tail of a project file.
- `mpic.`-dotted names (`mpic.linker.recipe`, `mpic.kernels.attention.selected_attention`,
  `mpic.deployments.app:app_builder`): the longest prefix that is a project module exists and
  the rest resolves in its source: a top-level definition or import (project imports followed),
  then a member of that class. A two-part `mpic.<x>` that is neither is a field of the API's
  `mpic` request/response object (`mpic.recompute_budget`) and is skipped.
- CamelCase `Class`, `Class.member`, `Class.a/b/c` (call arguments and subscripts dropped:
  `MPICHome().store_dir`): a class of that name in the project's sources (packages, tests,
  scripts) defines the member in its body, sets it as `self.<member>` or inherits it from a
  project base class (from a third-party base: found by importing the class). A name that is no
  project class must occur in the project's code (a third-party class the code uses; members
  unchecked) or be in `FOREIGN`.
- ALL_CAPS names of 3+ characters (`DEFAULT_BUDGET`): defined in some module or class, or used in
  the code; environment variables pass (`MPIC_*`, `VLLM_*`, `RAY_*`, or named in a shell script
  under scripts/, `run`, the Dockerfile or k8s/).
- `module.member` where module is a project module's short name (`link_job.batchable`): a module
  of that name defines the member, at top level or in one of its classes. Skipped: first parts
  that are serving-config sections (`engine.kind`: config keys) or names a third-party import
  binds (`vllm.general_plugins`, `torch.compile`), JSON paths with an index (`messages.0.role`),
  file names (`config.json`). Where the short name is also a variable's (`spec`, `app`), the
  member occurring in the code is enough.
- Calls `name(...)` and `name(...) -> T` are checked by their callee; a bare lower-case callee
  is a builtin or occurs in the code (a function, a method, a callable parameter).
- snake_case words with an underscore (`plan_prompt`, `link_prefix`, `ttft_target_s`) occur in
  the project's code: as an identifier, or as a string literal that is exactly the word
  (docstrings and comments do not count). Functions, attributes, config keys, JSON fields and
  metric names share the form, so this is the test they all pass; a metric name may carry Ray's
  `ray_` prefix and a `_total` / `_count` / `_sum` / `_bucket` suffix.
- CLI flags (`--images`, `--link-prefix/--no-link-prefix`) are options of some `mpic` /
  `mpic-admin` command; in a command span (`mpic bench offline --images 4,8`,
  `mpic-admin library refresh/list`) the subcommands exist and each flag is an option of that
  command (after a group: of one of its commands). Commands and options come from the typer apps.
- Fenced blocks: the `mpic` / `mpic-admin` command lines of shell blocks (as command spans) and
  `from mpic... import name` in Python blocks (as dotted names).

Deliberate exceptions: `ALLOWED` (token -> reason); third-party names the code never spells:
`FOREIGN` (origin -> names).
"""

from __future__ import annotations

import builtins
import re
from pathlib import Path

from tests.architecture.code_names import (
    PACKAGE_FOLDERS,
    ROOT,
    all_flags,
    class_has,
    cli_commands,
    code_index,
    config_sections,
    resolve_dotted,
    resolve_in,
)
from tests.architecture.doc_spans import COMMAND_START, command_lines, python_imports, spans

DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
PATH_ROOTS = {*PACKAGE_FOLDERS.values(), "docs", "scripts", "tests", "k8s"}
"""First folders of repo paths the docs name: such a path must exist."""
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

ALLOWED: dict[str, str] = {}
"""Backticked tokens that look like project names but are deliberately not (token -> reason)."""

FOREIGN: dict[str, set[str]] = {
    "vLLM": {
        "Attention",
        "SchedulerStats",
        "WAITING_FOR_REMOTE_KVS",
        "apply_model",
        "hf_to_vllm_mapper",
        "onednn_mm",
        "raw_logprobs",
        "request_success",
    },
    "vLLM's `vllm bench serve`": {"--backend", "--num-prompts"},
    "Ray Serve (LLM)": {
        "MockVLLMEngine",
        "ObjectRef",
        "PrefixCacheAffinityRouter",
        "imbalanced_threshold",
        "metrics_export_port",
    },
    "transformers": {
        "CLIPVisionModel",
        "recomposition_frequencies",
        "second_per_grid_t",
        "vision_model",
    },
    "LMCache": {"StorageBackendInterface"},
    "torch (profiler, aten ops)": {"FunctionEvent", "activity_type", "index_put_"},
    "OpenAI's API": {"json_schema"},
    "nginx": {"client_max_body_size"},
    "docker build": {"--build-arg"},
    "pip": {"--no-deps"},
}
"""Third-party names the docs cite and the project's code never spells (origin -> names); not
looked up. Third-party names the code uses pass on their own."""


# ----------------------------------------------------------------------------------- checks


def _is_foreign(name: str) -> bool:
    return any(name in names for names in FOREIGN.values())


def check_class_name(token: str) -> str | None:
    """`Class`, `Class.member` or `Class.a/b/c`."""
    index = code_index()
    head, _, rest = token.partition(".")
    if _is_foreign(head):
        return None
    if head not in index.classes:
        if index.defines(head) or head in index.words:
            return None  # a type alias, a third-party class the code uses: members unchecked
        return f"no class or name {head!r} in the project"
    if not rest:
        return None
    member = rest.split(".")[0]
    missing = [m for m in member.split("/") if m and not class_has(index, head, m)]
    return f"class {head} has no member {missing[0]!r}" if missing else None


def check_path(token: str) -> str | None:
    """A repo path under `PATH_ROOTS`, or a bare `.py` file, with an optional member suffix."""
    index = code_index()
    member = ""
    path = token
    for sep in ("::", ":"):
        if sep in path:
            path, _, member = path.partition(sep)
            break
    member = re.sub(r"\(.*$", "", member)
    top = path.split("/")[0]
    if top in PATH_ROOTS:
        if any(c in path for c in "*?["):
            return None if list(ROOT.glob(path)) else "matches no file"
        if not (ROOT / path).exists():
            stem, dot, attr = path.rpartition("/")[2].partition(".")
            module_file = ROOT / path.rpartition("/")[0] / f"{stem}.py"
            if dot and not member and module_file.is_file() and _IDENT.fullmatch(attr):
                path, member = str(module_file.relative_to(ROOT)), attr
            else:
                return "no such file or folder"
        files = [path]
    elif path.endswith(".py"):
        files = [f for f in index.files if f == path or f.endswith("/" + path)]
        if not files:
            return "no project file ends with it"
    else:
        return None
    if not member:
        return None
    modules = [m for m, p in index.modules.items() if str(p.relative_to(ROOT)) in files]
    for module in modules:
        if resolve_in(module, member.split(".")) is None:
            return None
    return f"{path} defines no {member!r}"


FILE_SUFFIXES = {"json", "jsonl", "yaml", "yml", "jinja", "txt", "md", "env", "png", "toml"}


def check_module_member(token: str) -> str | None:
    """`module.member` where module is a project module's short name."""
    index = code_index()
    head, *rest = token.split(".")
    if any(p.isdigit() for p in rest) or rest[-1] in FILE_SUFFIXES:
        return None  # a JSON path (`messages.0.role`) or a file name (`config.json`)
    modules = index.short(head)
    if not modules or head in config_sections() or head in index.foreign_modules:
        return None  # a config key (`engine.kind`), a third-party module's (`vllm.general_plugins`)
    for module in modules:
        if resolve_in(module, rest) is None:
            return None
        if any(
            rest[0] in c.members for cs in index.classes.values() for c in cs if c.module == module
        ):
            return None  # a method of a class of the module (`worker._shift_last_query`)
    if head in index.bound and rest[0] in index.words:
        return None  # also a variable's name (`spec.eos_token_id`, `app.calls`)
    return f"no module {head!r} defines {rest[0]!r}"


def check_callee(name: str) -> str | None:
    """A bare lower-case callee: a project function or method, or a builtin."""
    index = code_index()
    if hasattr(builtins, name) or name in index.functions or name in index.words:
        return None
    return f"no function, method or name {name!r} in the project's code"


def _flags(word: str) -> list[str]:
    """`--a/--b`, `[--a`, `--a=1` -> the flag names."""
    word = word.strip("[]()")
    return [w.split("=")[0] for w in word.split("/") if w.startswith("--")]


def check_command(words: list[str]) -> str | None:
    """`mpic bench offline --images 4,8`: subcommands exist, every flag is one of the command's."""
    commands = cli_commands()
    path = (Path(words[0]).name,)
    paths = [path]
    rest = words[1:]
    while rest and not rest[0].startswith(("-", "[")):
        subs = {c[-1] for c in commands if len(c) == len(path) + 1 and c[:-1] == path}
        if not subs:
            break  # a leaf: positional arguments follow
        if rest[0] == "...":
            return None
        alternatives = re.split(r"[|/]", rest[0])
        missing = [a for a in alternatives if a not in subs]
        if missing:
            return f"no command {' '.join((*path, missing[0]))!r}"
        paths = [(*path, a) for a in alternatives]
        path = paths[0]
        rest = rest[1:]
    under = {c: o for c, o in commands.items() if any(c[: len(p)] == p for p in paths)}
    for word in rest:
        for flag in _flags(word):
            if not any(flag in options for options in under.values()):
                return f"{' '.join(path)} has no option {flag}"
    return None


# --------------------------------------------------------------------------- classification

_CALL = re.compile(r"^([A-Za-z_][\w.]*)\((.*)\)(?:\s*->.*)?$")
_CAMEL = re.compile(r"^[A-Z][A-Za-z0-9_]*[a-z][A-Za-z0-9_]*(\.[\w/]+)*$")
_CAPS = re.compile(r"^[A-Z][A-Z0-9_]{2,}$")
_SNAKE = re.compile(r"^[a-z_][a-z0-9]*(_[a-z0-9]+)+_?$")
_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.\w+)+$")


def _strip_calls(token: str) -> str:
    """`A().b(x)["k"]` -> `A.b`: call arguments and subscripts dropped."""
    prev = None
    while prev != token:
        prev = token
        token = re.sub(r"\([^()]*\)|\[[^\[\]]*\]", "", token)
    return token


def check_token(token: str) -> str | None:
    """Why `token` (an inline code span) names nothing in the project, or None."""
    if token in ALLOWED:
        return None
    words = token.split()
    if words and COMMAND_START.match(words[0]) and len(words) > 1:
        return check_command(words)
    if token.startswith("--"):
        missing = [f for f in _flags(words[0]) if f not in all_flags() and not _is_foreign(f)]
        return f"no mpic / mpic-admin command has {missing[0]}" if missing else None
    if call := _CALL.match(token):
        name = call.group(1)
        if "." not in name and name[0].islower():
            return check_callee(name)
        token = name
    elif " " in token or "=" in token or "<" in token or "://" in token:
        return None
    if "/" in token and not _CAMEL.match(_strip_calls(token)):
        return check_path(token)
    if token.endswith(".py") or ".py:" in token:
        return check_path(token)
    token = _strip_calls(token)
    if re.fullmatch(r"mpic(\.\w+)+(:\w+)?", token):
        parts = token.replace(":", ".").split(".")
        if len(parts) == 2 and resolve_dotted(parts) is not None:
            return None  # `mpic.<field>`: the API's request/response object
        return resolve_dotted(parts)
    if _CAMEL.match(token):
        if token in {"True", "False", "None"} or (ROOT / token).exists():
            return None
        return check_class_name(token)
    if _CAPS.match(token):
        index = code_index()
        if token.startswith(("MPIC_", "VLLM_", "RAY_")) or _is_foreign(token) or token in index.env:
            return None  # an environment variable, a third-party name
        if (
            index.defines(token)
            or token in index.words
            or any(token in info.members for infos in index.classes.values() for info in infos)
        ):
            return None
        return f"no name {token!r} in the project"
    if _DOTTED.match(token):
        return check_module_member(token)
    if _SNAKE.match(token):
        metric = re.sub(r"_(total|count|sum|bucket)$", "", token.removeprefix("ray_"))
        if token in code_index().words or metric in code_index().words or _is_foreign(token):
            return None
        return f"{token!r} occurs nowhere in the project's code"
    return None


def problems(paths: list[Path] = DOCS) -> list[str]:
    """`file:line: `name`: why` for every backticked name that does not resolve, in page order."""
    found: list[tuple[str, int, str, str]] = []
    for path in paths:
        for span in spans(path):
            if span.fenced is None:
                found.append((span.file, span.line, span.text, check_token(span.text)))
                continue
            info = span.fenced.split()[0] if span.fenced else ""
            if info in ("", "bash", "sh", "shell", "console"):
                for offset, words in command_lines(span.text):
                    line = span.line + 1 + offset
                    found.append((span.file, line, " ".join(words), check_command(words)))
            if info in ("python", "py"):
                for offset, name in python_imports(span.text):
                    line = span.line + 1 + offset
                    found.append((span.file, line, name, resolve_dotted(name.split("."))))
    return [f"{file}:{line}: `{name}`: {why}" for file, line, name, why in sorted(found) if why]


if __name__ == "__main__":
    found = problems()
    print("\n".join(found) or "every backticked name resolves")
    raise SystemExit(1 if found else 0)
