"""Content addresses (every process): the model fingerprint and a cache entry's address.

An entry is addressed by SHA-256 over (model fingerprint, canonical context, media bytes), so the
same image cached by the same model after the same context has one id on every node, and any
change of weights, chat template or system prompt gives new ids (docs/design.md "Contracts").

The model fingerprint is SHA-256 over config.json and each weight file's own SHA-256. Those are
taken from the checkpoint where it already records them (a Hugging Face cache blob is named by
its SHA-256; `huggingface_hub` downloads into a folder record the file's SHA-256 etag), else
hashed once and remembered per (path, size, mtime) under `$MPIC_CACHE_DIR` (default
`~/.cache/mpic`), so a replica start does not re-read 15 GB of 7B weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 22


def entry_key(model_fingerprint: str, canonical_context: str, media: bytes) -> str:
    """sha256 hex over (model fingerprint, canonical context string, media bytes). Fields are
    length-prefixed so no two triples collide."""
    h = hashlib.sha256(b"mpic-entry-key/1")
    for part in (model_fingerprint.encode(), canonical_context.encode(), media):
        h.update(struct.pack("<Q", len(part)))
        h.update(part)
    return h.hexdigest()


def context_key(context_ids: Sequence[int]) -> str:
    """The canonical context (token ids before the item) as the string part of an address."""
    return "ids:" + ",".join(str(int(i)) for i in context_ids)


def entry_address(model_fingerprint: str, context_ids: Sequence[int], media: bytes) -> str:
    """THE address of a cache entry: the item `media` cached after `context_ids`."""
    return entry_key(model_fingerprint, context_key(context_ids), media)


def library_fingerprint(model_fingerprint: str, system_prompt: str | None) -> str:
    """What a dynamic-library version's entries depend on: the model and the system prompt of
    the canonical context (None: the chat template's default)."""
    if system_prompt is None:
        return model_fingerprint
    return f"{model_fingerprint}:{hashlib.sha256(system_prompt.encode()).hexdigest()[:16]}"


def model_fingerprint(path: str | os.PathLike[str]) -> str:
    """sha256 over config.json's bytes and every weight file's (name, sha256), sorted by name."""
    root = Path(path)
    digest = hashlib.sha256()
    config = root / "config.json"
    if config.is_file():
        digest.update(b"config.json\0" + config.read_bytes())
    for p in sorted(p for p in root.iterdir() if p.name.endswith(WEIGHT_SUFFIXES)):
        digest.update(f"{p.name}\0{file_sha256(p)}\0".encode())
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    """The file's SHA-256: from the checkpoint's own record when it has one, else computed once
    per (path, size, mtime) and remembered."""
    if path.is_symlink():  # Hugging Face cache: snapshots/<rev>/<name> -> blobs/<sha256>
        target = os.readlink(path)
        if _HEX64.match(os.path.basename(target)):
            return os.path.basename(target)
    meta = path.parent / ".cache" / "huggingface" / "download" / f"{path.name}.metadata"
    if meta.is_file():  # huggingface_hub local_dir: commit, etag, timestamp
        lines = meta.read_text().splitlines()
        if len(lines) > 1 and _HEX64.match(lines[1].strip().strip('"')):
            return lines[1].strip().strip('"')
    stat = path.stat()
    return _remembered_sha256(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=256)
def _remembered_sha256(path: str, size: int, mtime_ns: int) -> str:
    key = hashlib.sha256(f"{path}\0{size}\0{mtime_ns}".encode()).hexdigest()
    cache = Path(os.environ.get("MPIC_CACHE_DIR", Path.home() / ".cache" / "mpic")) / "sha256"
    record = cache / f"{key}.json"
    try:
        return json.loads(record.read_text())["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    value = digest.hexdigest()
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = record.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"path": path, "size": size, "sha256": value}))
        os.replace(tmp, record)
    except OSError:
        pass  # a read-only home: hash again next start
    return value
