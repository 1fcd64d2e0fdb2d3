"""The prompts of `mpic bench fidelity` and the benchmarks that reuse them (CLI process): real
prose that needs no download, the docstrings of standard-library modules (`passages`, each cut at
a paragraph boundary to ~`chars` characters), linked as cached documents into a question prompt
in one of three layouts (`question_parts`: the documents in the user turn, the system prompt, or
a first user turn the assistant acknowledged), or images into a question prompt
(`image_parts`); VLCache's calibration on proxy prompts built from other passages
(`calibrate_vlcache_on_documents`).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.progress import Progress

    from mpic.engine.protocol import Engine
    from mpic.prompt_parts import PromptPart
    from mpic.types import CacheEntry

logger = logging.getLogger(__name__)

_MODULES = (
    "json",
    "heapq",
    "difflib",
    "argparse",
    "csv",
    "copy",
    "configparser",
    "statistics",
    "collections",
    "fileinput",
    "hashlib",
    "itertools",
    "random",
    "sched",
    "shelve",
    "timeit",
    "uuid",
    "wave",
    "plistlib",
    "struct",
    "subprocess",
    "socketserver",
    "cmd",
    "tempfile",
    "unittest",
    "doctest",
    "inspect",
    "tokenize",
    "smtplib",
    "ftplib",
    # appended for larger proxy sets (`calibrate-scout`), after every passage a benchmark uses
    "pickle",
    "string",
    "re",
    "typing",
    "zlib",
    "locale",
    "gettext",
    "fnmatch",
    "sqlite3",
    "ssl",
    "pdb",
    "trace",
    "gc",
    "site",
    "getopt",
    "optparse",
    "pprint",
    "io",
    "pickletools",
    "zipimport",
    "mimetypes",
    "colorsys",
    "wsgiref",
    "marshal",
    "dbm",
)
"""Standard-library modules whose docstrings are the passages, in this order (those with too
short a docstring are skipped). The first 30 are the benchmarks' (`mpic bench fidelity` takes
the first 16, calibrations skip those); the rest only lengthen what calibrations can take, so
every benchmark prompt is the same as before they were added. None is a module Python 3.13
removed."""

_QUESTIONS = (
    "What is the {name} module for? Answer in one sentence.",
    "Summarize the document about the {name} module in two sentences.",
    "Which functions or classes does the {name} module provide, according to the documents?",
    "Explain to a beginner when they would use the {name} module.",
)


@dataclass(frozen=True)
class Passage:
    """One real text passage: the module it documents and the text."""

    name: str
    text: str


def passages(count: int, chars: int = 700, skip: int = 0) -> list[Passage]:
    """`count` standard-library docstrings (after skipping `skip` usable ones), each cut at a
    paragraph (else line) boundary to at most ~`chars` characters. ValueError if the running
    Python has fewer usable ones."""
    import importlib

    out: list[Passage] = []
    usable = 0
    for name in _MODULES:
        try:
            doc = inspect.getdoc(importlib.import_module(name)) or ""
        except ImportError:
            continue
        doc = doc.strip()
        if len(doc) < chars // 2:
            continue
        usable += 1
        if usable <= skip:
            continue
        out.append(Passage(name, _cut(doc, chars)))
        if len(out) == count:
            return out
    raise ValueError(f"only {len(out)} standard-library passages available, {count} needed")


def _cut(text: str, chars: int) -> str:
    """The text up to the last paragraph (or line) end within `chars` characters."""
    if len(text) <= chars:
        return text
    head = text[:chars]
    for sep in ("\n\n", "\n"):
        end = head.rfind(sep)
        if end >= chars // 2:
            return head[:end].rstrip()
    return head.rstrip()


LAYOUTS = ("user", "system", "two-turn")
"""Prompt layouts: the items and the question in one user turn; the items in the system turn and
the question in a user turn; a two-turn conversation whose second user turn links the same items
again (the first turn asks another question, the assistant's reply is a fixed sentence)."""

_INTRO = "Read the following documents from the Python standard library, then answer the question."
_REPLY = "I have read the documents."


def _item_block(docs: list[Passage], entry_ids: list[str]) -> list[PromptPart]:
    from mpic.prompt_parts import DocumentRef

    parts: list[PromptPart] = []
    for i, (doc, entry_id) in enumerate(zip(docs, entry_ids, strict=True), start=1):
        parts.append(f"\n\nDocument {i} ({doc.name}):\n")
        parts.append(DocumentRef(entry_id))
    return parts


def _question(docs: list[Passage], question: int) -> str:
    """Question q asks about document q mod n with template (q + q // n) mod 4, so the first
    max(n, 4) questions over n documents are distinct prompts (with 4 documents, questions
    4-7 are not questions 0-3 again)."""
    n = len(docs)
    target = docs[question % n]
    template = _QUESTIONS[(question + question // n) % len(_QUESTIONS)]
    return "Question: " + template.format(name=target.name)


def question_parts(
    docs: list[Passage], entry_ids: list[str], question: int, layout: str = "user"
) -> list[PromptPart]:
    """The prompt of question `question` over `docs` (cached as `entry_ids`) in `layout`
    (`LAYOUTS`): an introduction, "Document i (module):" before each document, the question
    last."""
    from mpic.prompt_parts import Turn

    block = _item_block(docs, entry_ids)
    if layout == "user":
        return [_INTRO, *block, "\n\n" + _question(docs, question)]
    if layout == "system":
        return [Turn("system"), _INTRO, *block, Turn("user"), _question(docs, question)]
    if layout == "two-turn":
        first = _question(docs, question + 1)
        again = "Here are the same documents again."
        return [
            _INTRO,
            *block,
            "\n\n" + first,
            Turn("assistant"),
            _REPLY,
            Turn("user"),
            again,
            *block,
            "\n\n" + _question(docs, question),
        ]
    raise ValueError(f"unknown layout {layout!r}; valid: {', '.join(LAYOUTS)}")


def image_parts(entry_ids: list[str], question: int) -> list[PromptPart]:
    """A prompt over cached images (LLaVA with the trained language model): the images between
    short text, then a question about one of them."""
    from mpic.prompt_parts import ImageRef

    parts: list[PromptPart] = ["Look at the following pictures."]
    for i, entry_id in enumerate(entry_ids, start=1):
        parts += [f"\nPicture {i}:\n", ImageRef(entry_id)]
    asks = (
        "Describe picture {i}.",
        "What colours are in picture {i}?",
        "Compare picture {i} with the others.",
        "What is shown in picture {i}? Answer briefly.",
    )
    i = question % len(entry_ids) + 1
    parts.append("\n" + asks[question % len(asks)].format(i=i))
    return parts


def calibrate_vlcache_on_documents(
    engine: Engine,
    target: float,
    grid: str,
    documents: int,
    prompts: int,
    chars: int = 700,
    progress: Progress | None = None,
) -> str:
    """VLCache's calibrated per-layer schedule for this model (the registry name), measured on
    `prompts` proxy prompts of `documents` passages disjoint from the benchmark's (VLCache
    section 4.1, `mpic.linker.calibration.vlcache.calibrate`); its prefill passes are counted
    on `progress` when given. The passages are cached and planned through `engine`
    (`Engine.cache_document`, `Engine.plan`); the calibration's prefills run through its
    `layer_adapter` (an optional `Engine` member: the reference engine's; ValueError without
    it)."""
    from mpic.linker.calibration.vlcache import (
        ProxyPrompt,
        calibrate,
        calibrate_with_progress,
        parse_grid,
    )

    adapter = getattr(engine, "layer_adapter", None)
    if adapter is None:
        raise ValueError("VLCache's calibration needs the engine's layer_adapter")
    # The benchmark uses the first passages; the proxy set takes the ones after its maximum (16).
    docs = passages(documents * prompts, chars, skip=16)
    proxies = []
    entries: dict[str, CacheEntry] = {}
    for p in range(prompts):
        chunk = docs[p * documents : (p + 1) * documents]
        cached = [engine.cache_document(d.text) for d in chunk]
        entries.update((e.entry_id, e) for e in cached)
        ids = [e.entry_id for e in cached]
        planned = engine.plan(question_parts(chunk, ids, p), entries=entries)
        proxies.append(ProxyPrompt(planned.plan, planned.entries))
    levels = parse_grid(grid)
    if progress is None:
        cal = calibrate(adapter, proxies, target, levels)
    else:
        cal = calibrate_with_progress(adapter, proxies, target, levels, progress)
    logger.info("calibrated %s: proxy %s", cal.policy, cal.proxy)
    return cal.policy
