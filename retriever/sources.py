"""Where a dynamic-library refresh reads its reference images: a local folder or an S3 prefix,
plus an optional captions JSONL (runs in the admin CLI process or the Retriever Serve replica).

A source is listed once (names in sorted order) and read lazily, one image at a time, so a large
collection is never held in memory whole. Only files with an image extension are taken; a file
that has one but does not decode fails the refresh before anything is written.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mpic.errors import InvalidRequestError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")


@dataclass(frozen=True)
class ImageSource:
    """Named images: `names` (relative, '/'-separated, sorted) and `read(name) -> bytes`."""

    location: str
    names: list[str]
    read: Callable[[str], bytes]


def _is_image(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return not base.startswith(".") and base.lower().endswith(IMAGE_SUFFIXES)


def open_source(location: str) -> ImageSource:
    """A local folder path or `s3://bucket/prefix?endpoint=host:port&secure=false`.

    Raises InvalidRequestError for a missing folder, an unreachable bucket, or no images.
    """
    if location.startswith("s3://"):
        from mpic.storage.factory import make_object_store

        try:
            store = make_object_store(location)
            names = [k for k in store.list("") if _is_image(k)]
        except (ValueError, OSError) as exc:
            raise InvalidRequestError(f"cannot list {location}: {exc}", param="source") from exc
        source = ImageSource(location, names, store.get)
    else:
        root = Path(location)
        if not root.is_dir():
            raise InvalidRequestError(f"source folder not found: {root}", param="source")
        names = sorted(
            p.relative_to(root).as_posix()
            for p in root.rglob("*")
            if p.is_file() and _is_image(p.relative_to(root).as_posix())
        )
        source = ImageSource(str(root), names, lambda name: (root / name).read_bytes())
    if not source.names:
        raise InvalidRequestError(
            f"no images ({', '.join(IMAGE_SUFFIXES)}) under {location}", param="source"
        )
    return source


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
