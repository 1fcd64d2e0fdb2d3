"""The code spans of a Markdown page: inline spans (joined across line breaks, as Markdown
does) and fenced blocks, with their line numbers; the `mpic` / `mpic-admin` command lines of
shell blocks and the `mpic` imports of Python blocks. For the docs' name check
(`tests/architecture/doc_names.py`).
"""

from __future__ import annotations

import ast
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.architecture.code_names import ROOT


@dataclass(frozen=True)
class Span:
    file: str
    line: int
    text: str
    fenced: str | None = None
    """The fenced block's info string ("" for none); None: an inline code span."""


_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})(.*)$")


def spans(path: Path) -> Iterator[Span]:
    """Inline code spans (whitespace collapsed, `\\|` unescaped) and fenced blocks of a page."""
    name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    lines = path.read_text().splitlines()
    prose: list[str] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            prose.append(lines[i])
            i += 1
            continue
        fence, info, start = m.group(1), m.group(2).strip(), i
        close = re.compile(rf"[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*")
        i += 1
        body = []
        while i < len(lines) and not close.fullmatch(lines[i]):
            body.append(lines[i])
            i += 1
        yield Span(name, start + 1, "\n".join(body), fenced=info)
        prose.extend([""] * (i + 1 - start))  # keep line numbers; blank lines end paragraphs
        i += 1
    text = "\n".join(prose)
    pos = 0
    ticks = re.compile(r"`+")
    while (m := ticks.search(text, pos)) is not None:
        run = m.group()
        end = re.compile(rf"(?<!`){run}(?!`)").search(text, m.end())
        if end is None or re.search(r"\n[ \t]*\n", text[m.end() : end.start()]):
            pos = m.end()
            continue
        body = " ".join(text[m.end() : end.start()].split()).replace("\\|", "|")
        if body:
            yield Span(name, text.count("\n", 0, m.start()) + 1, body)
        pos = end.end()


COMMAND_START = re.compile(r"^(?:\.venv/bin/)?(mpic|mpic-admin)$")


def command_lines(block: str) -> Iterator[tuple[int, list[str]]]:
    """(line offset, words) of each `mpic` / `mpic-admin` command in a shell block (`\\`
    continuations joined; `&&`, `;` and `||` separate commands)."""
    start, logical = 0, ""
    for offset, line in enumerate(block.splitlines()):
        if not logical:
            start = offset
        if line.rstrip().endswith("\\"):
            logical += line.rstrip()[:-1] + " "
            continue
        logical, text = "", logical + line
        for part in re.split(r"&&|;|\|\|", text):
            try:
                words = shlex.split(part, comments=True)
            except ValueError:
                words = part.split("#")[0].split()
            while words and (words[0] == "$" or re.fullmatch(r"\w+=\S*", words[0])):
                words = words[1:]
            if words and COMMAND_START.match(words[0]):
                yield start, words


def python_imports(block: str) -> Iterator[tuple[int, str]]:
    """(line offset, dotted name) of each `from mpic... import name` / `import mpic...`."""
    try:
        tree = ast.parse(block)
    except SyntaxError:
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mpic"):
            for a in node.names:
                yield node.lineno - 1, f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("mpic"):
                    yield node.lineno - 1, a.name
