"""`mpic bench storage` (CLI process): cache-entry load throughput per tier against a raw read of
the same bytes from the same medium (MPIC section 3.2: loads run beside recomputation, so a load
must cost about what moving the bytes costs).

Per entry size (MiB) and tier:
- memory: `EntryStore.get` of a resident entry vs a memcpy of the encoded blob;
- disk: `DiskTier.get` (private mmap + BLAKE3 verify + zero-copy decode) vs `readinto` of the
  same file into a buffer allocated once beforehand (the cheapest raw read), measured COLD (page
  cache dropped for that file with posix_fadvise(DONTNEED) before every read, both sides) and
  WARM (file in the page cache, both sides);
- s3 (with `--s3-url`, or `--s3-url moto` for a loopback moto server): `EntryStore` object-tier
  load vs a plain minio GET of the same object.
Entry and raw runs are interleaved in alternating order so load from other processes hits
both alike; a cell runs at least `--repeat` pairs and, for small entries, more until 2 s have
passed. Throughputs are medians (best runs beside them); `ratio` = median raw time / median
entry time (= entry throughput / raw throughput). Target: cold disk-tier ratio >= 0.8.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

MIB = 1 << 20


def _entry_of_mib(mib: float, seed: int):  # noqa: ANN202 - CacheEntry, torch imported lazily
    """A synthetic f32 entry of about `mib` MiB (8 layers, 8 KV heads x 64, hidden 512)."""
    import torch

    from mpic.addressing import entry_key
    from mpic.types import CacheEntry

    per_token = 2 * 8 * 8 * 64 * 4 + 512 * 4
    t = max(1, round(mib * MIB / per_token))
    g = torch.Generator().manual_seed(seed)
    media = f"bench-{mib}-{seed}".encode()
    return CacheEntry(
        entry_id=entry_key("bench", "ctx", media),
        model_fingerprint="bench",
        keys=torch.randn(8, t, 8, 64, generator=g),
        values=torch.randn(8, t, 8, 64, generator=g),
        positions=torch.arange(t),
        input_embeds=torch.randn(t, 512, generator=g),
    )


def _paired(
    entry_fn: Callable[[], object],
    raw_fn: Callable[[], object],
    repeat: int,
    before: Callable[[], None] | None = None,
    min_seconds: float = 2.0,
) -> tuple[list[float], list[float]]:
    """Seconds of each run of (entry_fn, raw_fn), interleaved in alternating order so load from
    other processes hits both sides alike; at least `repeat` pairs and, for small entries, as
    many more as fit in `min_seconds`. `before` runs before every single timed call."""
    times: tuple[list[float], list[float]] = ([], [])
    start, rep = time.perf_counter(), 0
    while rep < repeat or (time.perf_counter() - start < min_seconds and rep < 50 * repeat):
        for side in (0, 1) if rep % 2 == 0 else (1, 0):
            if before:
                before()
            t0 = time.perf_counter()
            (entry_fn, raw_fn)[side]()
            times[side].append(time.perf_counter() - t0)
        rep += 1
    return times


def _drop_cache(path: Path) -> Callable[[], None]:
    def drop() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    return drop


def _raw_file_read(path: Path, size: int) -> Callable[[], bytearray]:
    buf = bytearray(size)

    def read() -> bytearray:
        with open(path, "rb", buffering=0) as f:
            view, got = memoryview(buf), 0
            while got < size:
                got += f.readinto(view[got:])
        return buf

    return read


def _row(size_mib: float, tier: str, nbytes: int, t_entry: list[float], t_raw: list[float]) -> dict:
    med_e, med_r = statistics.median(t_entry), statistics.median(t_raw)
    return {
        "size_mib": size_mib,
        "tier": tier,
        "bytes": nbytes,
        "runs": len(t_entry),
        "entry_MiB_s": nbytes / MIB / med_e,
        "raw_MiB_s": nbytes / MIB / med_r,
        "ratio": med_r / med_e,
        "best_entry_MiB_s": nbytes / MIB / min(t_entry),
        "best_raw_MiB_s": nbytes / MIB / min(t_raw),
        "entry_s": t_entry,
        "raw_s": t_raw,
    }


def _measure_size(mib: float, seed: int, repeat: int, workdir: Path, s3) -> list[dict]:  # noqa: ANN001
    """Rows of one entry size: memory, disk cold/warm, and s3 when `s3` is an ObjectStore."""
    from mpic.storage.entry_codec import encode
    from mpic.storage.entry_store import EntryStore, entry_object_key
    from mpic.storage.fs_store import FileSystemObjectStore
    from mpic.storage.tiers.disk import DiskTier

    entry = _entry_of_mib(mib, seed)
    key, blob = entry.entry_id, encode(entry)
    n = len(blob)
    store = EntryStore(
        FileSystemObjectStore(workdir / "objects", fsync=False),
        memory_bytes=4 * n,
        disk=DiskTier(workdir / "disk", 4 * n),
    )
    store.put(entry)
    rows = [
        _row(mib, "memory", n, *_paired(lambda: store.get(key), lambda: bytearray(blob), repeat))
    ]
    path = store.disk.store.path(key)
    raw = _raw_file_read(path, n)
    for mode, before in (("cold", _drop_cache(path)), ("warm", None)):
        raw()
        rows.append(
            _row(mib, f"disk-{mode}", n, *_paired(lambda: store.disk.get(key), raw, repeat, before))
        )
    store.delete(key)
    if s3 is not None:
        remote = EntryStore(s3, memory_bytes=0)
        remote.put(entry)
        rows.append(
            _row(
                mib,
                "s3",
                n,
                *_paired(lambda: remote.get(key), lambda: s3.get(entry_object_key(key)), repeat),
            )
        )
        s3.delete(entry_object_key(key))
    return rows


def run(sizes: list[float], repeat: int, workdir: Path, s3_url: str | None) -> list[dict]:
    """Measure every (size, tier) cell; returns the result rows."""
    from tqdm import tqdm

    from mpic.storage.factory import make_object_store

    s3 = make_object_store(s3_url) if s3_url else None
    rows: list[dict] = []
    for i, mib in enumerate(tqdm(sizes, desc="entry sizes")):
        rows += _measure_size(mib, i, repeat, workdir, s3)
    return rows


def _print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Entry load vs raw read of the same bytes (MiB/s, medians)")
    for col in (
        "size MiB",
        "tier",
        "entry load",
        "raw read",
        "entry/raw",
        "best entry",
        "best raw",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            f"{r['size_mib']:g}",
            r["tier"],
            f"{r['entry_MiB_s']:,.0f}",
            f"{r['raw_MiB_s']:,.0f}",
            f"{r['ratio']:.2f}",
            f"{r['best_entry_MiB_s']:,.0f}",
            f"{r['best_raw_MiB_s']:,.0f}",
        )
    Console().print(table)


def _plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tiers = [t for t in ("disk-cold", "disk-warm", "s3") if any(r["tier"] == t for r in rows)]
    fig, axes = plt.subplots(1, len(tiers), figsize=(4.5 * len(tiers), 3.8), squeeze=False)
    for ax, tier in zip(axes[0], tiers, strict=True):
        sel = [r for r in rows if r["tier"] == tier]
        x = range(len(sel))
        ax.bar([i - 0.2 for i in x], [r["entry_MiB_s"] for r in sel], 0.4, label="entry load")
        ax.bar([i + 0.2 for i in x], [r["raw_MiB_s"] for r in sel], 0.4, label="raw read")
        for i, r in zip(x, sel, strict=True):
            ax.annotate(
                f"{r['ratio']:.2f}x",
                (i, max(r["entry_MiB_s"], r["raw_MiB_s"])),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_xticks(list(x), [f"{r['size_mib']:g} MiB" for r in sel])
        ax.set_title(tier)
        ax.set_ylabel("MiB/s")
        ax.legend(fontsize=8)
    fig.suptitle("MPIC storage: entry load (verify + decode) vs raw read of the same bytes")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def command(
    sizes: Annotated[str, typer.Option("--sizes", help="Entry sizes in MiB.")] = "1,10,100",
    json_out: Annotated[Path | None, typer.Option("--json", help="Write rows here.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a PNG chart here.")] = None,
    repeat: Annotated[int, typer.Option("--repeat", min=1, help="Least runs per cell.")] = 7,
    workdir: Annotated[
        Path | None,
        typer.Option("--workdir", help="Folder on the disk to measure (default: the current one)."),
    ] = None,
    s3_url: Annotated[
        str | None,
        typer.Option(
            "--s3-url",
            help="s3://bucket/prefix?endpoint=... adds an S3 tier; 'moto' starts a "
            "loopback moto server.",
        ),
    ] = None,
) -> None:
    """Entry load throughput per tier vs raw reads of the same bytes (table, JSON, PNG)."""
    try:
        size_list = [float(s) for s in sizes.split(",") if s.strip()]
    except ValueError:
        raise typer.BadParameter(f"--sizes must be numbers, got {sizes!r}") from None
    if not size_list or min(size_list) <= 0:
        raise typer.BadParameter("--sizes needs positive sizes in MiB")
    server = None
    if s3_url == "moto":
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port(), verbose=False)
        server.start()
        s3_url = (
            f"s3://mpic-bench/b?endpoint=127.0.0.1:{server._port}&secure=false"
            "&region=us-east-1&access_key=bench&secret_key=bench"
        )
    try:
        with tempfile.TemporaryDirectory(dir=workdir or Path.cwd(), prefix=".mpic-bench-") as d:
            rows = run(size_list, repeat, Path(d), s3_url)
    finally:
        if server is not None:
            server.stop()
    _print_table(rows)
    cold = [r for r in rows if r["tier"] == "disk-cold"]
    ok = all(r["ratio"] >= 0.8 for r in cold)
    ratios = ", ".join(f"{r['ratio']:.2f}" for r in cold)
    typer.echo(
        f"cold disk-tier entry load >= 0.8 x raw read: {'PASS' if ok else 'FAIL'} (ratios {ratios})"
    )
    result = {"rows": rows, "target": "disk-cold ratio >= 0.8", "pass": ok, "repeat": repeat}
    if json_out:
        json_out.write_text(json.dumps(result, indent=2))
    if plot:
        _plot(rows, plot)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
