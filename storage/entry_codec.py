"""Cache-entry codec: `mpic.types.CacheEntry` <-> bytes, and the entry content address (any
process that stores or loads KV: Serve replicas, vLLM workers, benchmarks).

The blob is a plain safetensors file (readable by `safetensors.torch.load`): tensors `keys`,
`values` [L, T, H_kv, D], `positions` int64 [T] or [3, T], `input_embeds` [T, hidden], laid out
in name order, and `__metadata__["mpic"]` = JSON {format, entry_id, model_fingerprint,
media_type, extra, dtype, num_tokens, checksums: {blake3, xxh3_128}}. Both checksums cover the
metadata (in a canonical JSON form, tensor layout included) and every tensor byte, so a decode
verifies all it hands out and raises `CorruptEntryError` on any mismatch, truncation or garbage.

`check="blake3"` (256-bit, cryptographic) guards bytes that come from the shared object store;
`check="xxh3_128"` (non-cryptographic, ~10 GB/s) guards the node's own disk-tier copies against
bit rot and torn files at close to read speed. Measured on the 2-core dev CPU: SHA-256 (SHA-NI)
0.5-1.1 GB/s, BLAKE3 1.9-2.5 GB/s, XXH3 8-10 GB/s, against cold local reads of 0.7-2 GB/s and
page-cache reads of 5-20 GB/s: SHA-256 would make every load hash-bound (MPIC section 3.2: loads
must be cheap enough to run beside recomputation). The content address (`mpic.addressing`) is
SHA-256 (docs/design.md). Decoding is zero-copy: tensors are views into the buffer that was read;
the streaming reader hashes chunk i in a helper thread while reading chunk i+1.
"""

from __future__ import annotations

import json
import mmap
import struct
import threading
from queue import SimpleQueue
from typing import Literal

import blake3
import torch
import xxhash

from mpic.errors import CorruptEntryError
from mpic.storage.object_store import ReadStream
from mpic.types import CacheEntry

FORMAT = "mpic-entry/1"
_TENSORS = ("input_embeds", "keys", "positions", "values")
_CHUNK = 512 << 10
Check = Literal["blake3", "xxh3_128"]
_MAX_HEADER = 16 << 20
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def _canonical(header: dict, meta: dict) -> bytes:
    """The metadata the checksums cover (tensor layout + entry metadata), in one fixed form."""
    return json.dumps(
        {"meta": meta, "tensors": header}, sort_keys=True, separators=(",", ":")
    ).encode()


def _hasher(check: Check, header: dict, meta: dict):  # noqa: ANN202 - blake3 or xxh3 object
    h = blake3.blake3() if check == "blake3" else xxhash.xxh3_128()
    h.update(_canonical(header, meta))
    return h


def encode(entry: CacheEntry) -> bytes:
    """Serialize `entry` (tensors moved to CPU) into one safetensors blob with checksums over
    its metadata and every tensor byte."""
    tensors = {
        "input_embeds": entry.input_embeds,
        "keys": entry.keys,
        "positions": entry.positions.to(torch.int64),
        "values": entry.values,
    }
    header: dict[str, dict] = {}
    raws, offset = [], 0
    for name in _TENSORS:
        t = tensors[name]
        if t.dtype not in _NAMES:
            raise ValueError(f"{name}: unsupported dtype {t.dtype}")
        raw = _raw(t)
        header[name] = {
            "dtype": _NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + raw.nbytes],
        }
        offset += raw.nbytes
        raws.append(raw)
    meta = {
        "format": FORMAT,
        "entry_id": entry.entry_id,
        "model_fingerprint": entry.model_fingerprint,
        "media_type": entry.media_type,
        "extra": entry.extra,
        "dtype": str(entry.keys.dtype).removeprefix("torch."),
        "num_tokens": entry.num_tokens,
    }
    sums = {}
    for check in ("blake3", "xxh3_128"):
        h = _hasher(check, header, meta)
        for raw in raws:
            h.update(raw)
        sums[check] = h.hexdigest()
    full = {**header, "__metadata__": {"mpic": json.dumps({**meta, "checksums": sums})}}
    hbytes = json.dumps(full, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    return b"".join([struct.pack("<Q", len(hbytes)), hbytes, *raws])


def _parse_header(hbytes: bytes | memoryview) -> tuple[dict, dict, dict]:
    """(tensor layout, metadata without checksums, checksums) of a blob header."""
    try:
        header = json.loads(bytes(hbytes))
        meta = json.loads(header.pop("__metadata__")["mpic"])
        sums = meta.pop("checksums")
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise CorruptEntryError(f"entry header unreadable: {e}") from e
    if meta.get("format") != FORMAT or set(header) != set(_TENSORS):
        raise CorruptEntryError(f"not an {FORMAT} blob")
    return header, meta, sums


def _data_size(header: dict) -> int:
    try:
        return max(int(h["data_offsets"][1]) for h in header.values())
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise CorruptEntryError(f"entry header malformed: {e}") from e


def _build(
    header: dict, meta: dict, expected: object, buf: bytearray | memoryview, base: int, digest: str
) -> CacheEntry:
    if digest != expected:
        raise CorruptEntryError(f"entry {meta.get('entry_id')}: checksum mismatch")
    out: dict[str, torch.Tensor] = {}
    try:
        for name, h in header.items():
            b, e = (int(x) for x in h["data_offsets"])
            dtype = _DTYPES[h["dtype"]]
            count = (e - b) // dtype.itemsize
            t = (
                torch.frombuffer(buf, dtype=dtype, count=count, offset=base + b)
                if count
                else torch.empty(0, dtype=dtype)
            )
            out[name] = t.view(*h["shape"])
        entry = CacheEntry(
            entry_id=meta["entry_id"],
            model_fingerprint=meta["model_fingerprint"],
            keys=out["keys"],
            values=out["values"],
            positions=out["positions"],
            input_embeds=out["input_embeds"],
            media_type=meta["media_type"],
            extra=meta["extra"],
        )
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        raise CorruptEntryError(f"entry tensors malformed: {e}") from e
    if entry.keys.dim() != 4 or entry.keys.shape != entry.values.shape:
        raise CorruptEntryError("entry keys/values shapes disagree")
    return entry


def decode(blob: bytes | bytearray | memoryview | mmap.mmap, check: Check = "blake3") -> CacheEntry:
    """Bytes -> CacheEntry verified with the `check` checksum (tensors view `blob`);
    CorruptEntryError if anything is off."""
    view = memoryview(blob).cast("B")
    if view.readonly:  # tensors must own writable memory: copy once
        view = memoryview(bytearray(view))
    if len(view) < 8:
        raise CorruptEntryError("entry truncated (no header)")
    (n,) = struct.unpack("<Q", view[:8])
    if n > min(_MAX_HEADER, len(view) - 8):
        raise CorruptEntryError("entry truncated or header length garbage")
    header, meta, sums = _parse_header(view[8 : 8 + n])
    data = view[8 + n :]
    if len(data) != _data_size(header):
        raise CorruptEntryError(
            f"entry data is {len(data)} bytes, header says "
            f"{_data_size(header)} (truncated or garbage)"
        )
    h = _hasher(check, header, meta)
    h.update(data)
    return _build(header, meta, sums.get(check), view, 8 + n, h.hexdigest())


def _read_exact(stream: ReadStream, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = stream.readinto(view[got:])
        if not n:
            raise CorruptEntryError(f"entry truncated: {got} of {len(view)} bytes")
        got += n


def read_entry(stream: ReadStream) -> tuple[CacheEntry, bytearray]:
    """Read one blob from `stream` into a fresh buffer in large sequential reads (the first one
    also brings the header), hashing chunk i while reading chunk i+1. Returns the verified
    CacheEntry (BLAKE3-verified; its tensors view the buffer) and the whole blob buffer."""
    size = stream.size
    if size < 8:
        raise CorruptEntryError("entry truncated (no header)")
    buf = bytearray(size)
    view = memoryview(buf)
    have = min(size, _CHUNK)
    _read_exact(stream, view[:have])
    (n,) = struct.unpack("<Q", view[:8])
    if n > min(_MAX_HEADER, size - 8):
        raise CorruptEntryError("entry truncated or header length garbage")
    if 8 + n > have:
        _read_exact(stream, view[have : 8 + n])
        have = 8 + n
    header, meta, sums = _parse_header(view[8 : 8 + n])
    if size != 8 + n + _data_size(header):
        raise CorruptEntryError(
            f"entry object is {size} bytes, expected {8 + n + _data_size(header)}"
        )
    digest, chunks = _hasher("blake3", header, meta), SimpleQueue[memoryview | None]()
    hasher = threading.Thread(target=_hash_chunks, args=(digest, chunks), daemon=True)
    hasher.start()
    try:
        chunks.put(view[8 + n : have])
        for start in range(have, size, _CHUNK):
            _read_exact(stream, view[start : start + _CHUNK])
            chunks.put(view[start : start + _CHUNK])
    finally:
        chunks.put(None)
        hasher.join()
    return _build(header, meta, sums.get("blake3"), buf, 8 + n, digest.hexdigest()), buf


def _hash_chunks(digest: blake3.blake3, chunks: SimpleQueue) -> None:
    while (chunk := chunks.get()) is not None:
        digest.update(chunk)
