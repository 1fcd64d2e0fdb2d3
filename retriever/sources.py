"""Where a dynamic-library refresh reads its references: a local folder or an S3 prefix of images
and text passages, plus an optional captions JSONL (runs in the admin CLI process or the
Retriever Serve replica).

A source is listed once (names in sorted order) and read lazily, one file at a time, so a large
collection is never held in memory whole. Only files with an image extension or a text-document
one (.txt, .md, .markdown: UTF-8 passages) are taken; a file that has one but does not decode
fails the refresh before anything is written.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from mpic.documents import DOCUMENT_SUFFIXES, document_suffix_type
from mpic.errors import InvalidRequestError

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")


@dataclass(frozen=True)
class MediaSource:
    """Named images and text passages: `names` (relative, '/'-separated, sorted) and
    `read(name) -> bytes`."""

    location: str
    names: list[str]
    read: Callable[[str], bytes]


def media_type(name: str) -> str | None:
    """The kind of a reference file by its name's suffix: "image", "document" (a text passage)
    or None (another file, or a hidden one: its name starts with a dot)."""
    base = name.rsplit("/", 1)[-1]
    if base.startswith("."):
        return None
    if base.lower().endswith(IMAGE_SUFFIXES):
        return "image"
    return "document" if document_suffix_type(base) else None


def open_source(location: str) -> MediaSource:
    """A local folder path or `s3://bucket/prefix?endpoint=host:port&secure=false`.

    Raises InvalidRequestError for a missing folder, an unreachable bucket, or no images or
    passages.
    """
    if location.startswith("s3://"):
        from mpic.storage.factory import make_object_store

        try:
            store = make_object_store(location)
            names = [k for k in store.list("") if media_type(k)]
        except (ValueError, OSError) as exc:
            log.warning("cannot list source %s: %s", location, exc)
            raise InvalidRequestError(f"cannot list {location}", param="source") from None
        source = MediaSource(location, names, store.get)
    else:
        root = Path(location)
        if not root.is_dir():
            raise InvalidRequestError(f"source folder not found: {root}", param="source")
        names = sorted(
            p.relative_to(root).as_posix()
            for p in root.rglob("*")
            if p.is_file() and media_type(p.relative_to(root).as_posix())
        )
        source = MediaSource(str(root), names, lambda name: (root / name).read_bytes())
    if not source.names:
        raise InvalidRequestError(
            f"no images ({', '.join(IMAGE_SUFFIXES)}) or text passages "
            f"({', '.join(DOCUMENT_SUFFIXES)}) under {location}",
            param="source",
        )
    return source


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _is_plain_text(text: str) -> bool:
    """True for text a path or URL may hold: valid Unicode (no lone surrogate), no control
    characters (NUL makes the OS path calls raise), bounded length."""
    if len(text) > 4096 or any(ord(c) < 32 or ord(c) == 127 for c in text):
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def allowed_source(location: str, roots: Sequence[str], param: str = "source") -> str:
    """`location` if it lies under one of `roots` (the server's configured admin source roots:
    local folders and `s3://bucket/prefix[?endpoint=...]` prefixes), else InvalidRequestError
    (400), decided from the text alone: nothing is opened or connected to first (no SSRF, no
    reading the server's other folders).

    Local: the real path (symlinks and `..` resolved) must be inside a root's real path.
    S3: bucket and prefix must be under a root's, and the location may not name its own
    endpoint or options: it gets the root's (an s3 location without a query inherits it)."""
    refuse = InvalidRequestError(
        f"{param} is not under a configured admin source root (server config admin_sources)",
        param=param,
    )
    if not _is_plain_text(location):
        raise InvalidRequestError(
            f"{param} must be printable text (no control characters such as NUL, no lone "
            "surrogates, at most 4096 characters)",
            param=param,
        )
    if "://" in location and not location.startswith("s3://"):
        raise refuse
    if location.startswith("s3://"):
        want = urlsplit(location)
        dots = ".." in want.path.split("/")
        if want.query or want.fragment or "@" in want.netloc or dots:
            raise refuse
        for root in roots:
            if not root.startswith("s3://"):
                continue
            have = urlsplit(root)
            if want.netloc == have.netloc and _under(want.path or "/", have.path or "/"):
                return location + (f"?{have.query}" if have.query else "")
        raise refuse
    real = os.path.realpath(location)
    for root in roots:
        if "://" not in root and _under(real, os.path.realpath(root)):
            return real
    raise refuse


def read_captions(path: str | Path | None) -> dict[str, str]:
    """JSONL lines {"file": <name relative to the source>, "caption": <text>} -> {name: caption}.

    Raises InvalidRequestError naming the line of a malformed record.
    """
    if path is None:
        return {}
    path = Path(path)
    if not path.is_file():
        raise InvalidRequestError(f"captions file not found: {path}", param="captions")
    captions: dict[str, str] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            captions[str(record["file"])] = str(record["caption"])
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidRequestError(
                f'{path}:{lineno}: expected {{"file": ..., "caption": ...}} ({exc})',
                param="captions",
            ) from exc
    return captions
