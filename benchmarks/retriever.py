"""`mpic bench retriever` (CLI process): FAISS build time, single-query latency (p50/p99) and
recall@10 of the approximate indexes (IVF, HNSW) against exact flat search, for the index kinds
of `mpic.retriever.index` at several collection sizes.

Data: clustered random unit vectors (Gaussian blobs around random unit centres, then
L2-normalised), so the IVF cells and HNSW graph have structure to exploit as CLIP embeddings do;
queries are fresh draws from the same blobs (not in the index). Ground truth = flat search.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

logger = logging.getLogger(__name__)

KINDS = ("flat", "ivf", "hnsw")
SPREAD = 2.5
"""Noise norm relative to the unit centre: a point's cosine to its centre is about 0.37."""
SEARCH_SWEEP: dict[str, list[dict]] = {
    "flat": [{}],
    "ivf": [{"nprobe": 16}, {"nprobe": 64}],
    "hnsw": [{"ef_search": 64}, {"ef_search": 256}],
}
"""Search-time knobs measured on each built index (the first of each is the default)."""


def clustered_unit_vectors(
    n: int, dim: int, *, clusters: int, spread: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(centres float32 [clusters, dim], points float32 [n, dim]); all rows unit length.

    Each point = its cluster centre + N(0, spread^2 / dim) per coordinate, renormalised.
    """
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, dim)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    return centres, _draw(rng, centres, n, spread)


def _draw(rng: np.random.Generator, centres: np.ndarray, n: int, spread: float) -> np.ndarray:
    dim = centres.shape[1]
    points = centres[rng.integers(0, len(centres), n)]
    points = points + rng.standard_normal((n, dim)).astype(np.float32) * (spread / np.sqrt(dim))
    return (points / np.linalg.norm(points, axis=1, keepdims=True)).astype(np.float32)


def recall_at_k(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean over queries of |found_i ∩ truth_i| / k; both int64 [q, k]."""
    hits = [len(set(f.tolist()) & set(t.tolist())) for f, t in zip(found, truth, strict=True)]
    return float(np.mean(hits) / truth.shape[1])


def _single_query_latencies(index, qs: np.ndarray, k: int) -> list[float]:
    """Seconds per one-query search, on one OpenMP thread (as a Serve replica answers one
    request; several threads on a shared 2-core machine spin and inflate the tail)."""
    import faiss

    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        lat = []
        for q in qs:
            t0 = time.perf_counter()
            index.search(q[None], k)
            lat.append(time.perf_counter() - t0)
    finally:
        faiss.omp_set_num_threads(threads)
    return lat


def bench_size(n: int, dim: int, *, queries: int, k: int, seed: int) -> list[dict]:
    """One row per index kind for a collection of n vectors."""
    from mpic.retriever.index import IndexConfig, VectorIndex

    rng = np.random.default_rng(seed + 1)
    centres, data = clustered_unit_vectors(
        n, dim, clusters=max(8, n // 100), spread=SPREAD, seed=seed
    )
    qs = _draw(rng, centres, queries, SPREAD)
    ids = np.arange(n, dtype=np.int64)
    rows, truth = [], None
    for kind in KINDS:
        t0 = time.perf_counter()
        built = VectorIndex.build(data, ids, IndexConfig(kind=kind, use_gpu="never"))
        build_s = time.perf_counter() - t0
        for search in SEARCH_SWEEP[kind]:
            cfg = IndexConfig(kind=kind, use_gpu="never", **search)
            index = VectorIndex(built.cpu_index, cfg)  # same index, other search knobs
            lat = _single_query_latencies(index, qs, k)
            _, found = index.search(qs, k)
            truth = found if kind == "flat" else truth
            assert truth is not None  # flat runs first
            rows.append(
                {
                    "vectors": n,
                    "dim": dim,
                    "kind": kind,
                    "search": _label(search),
                    "build_s": round(build_s, 3),
                    "p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 3),
                    "p99_ms": round(float(np.percentile(lat, 99)) * 1e3, 3),
                    f"recall@{k}": round(recall_at_k(found, truth), 4),
                    "params": cfg.model_dump(exclude={"use_gpu"}),
                }
            )
            logger.info("%s", rows[-1])
    return rows


def _label(search: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in search.items()) or "-"


def plot(rows: list[dict], png: Path, k: int) -> None:
    """Latency p50/p99 and recall@k per kind against collection size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_lat, ax_rec) = plt.subplots(1, 2, figsize=(10, 4))
    for kind in KINDS:
        for search in SEARCH_SWEEP[kind]:
            label = f"{kind} {_label(search)}" if search else kind
            sel = [r for r in rows if r["kind"] == kind and r["search"] == _label(search)]
            xs = [r["vectors"] for r in sel]
            ax_lat.plot(xs, [r["p50_ms"] for r in sel], "o-", label=f"{label} p50")
            ax_lat.plot(xs, [r["p99_ms"] for r in sel], "x--", label=f"{label} p99")
            ax_rec.plot(xs, [r[f"recall@{k}"] for r in sel], "o-", label=label)
    for ax, title in ((ax_lat, "single-query latency (ms)"), (ax_rec, f"recall@{k} vs flat")):
        ax.set_xscale("log")
        ax.set_xlabel("vectors")
        ax.set_title(title)
        ax.legend(fontsize=7)
    ax_lat.set_yscale("log")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def print_table(rows: list[dict], k: int) -> None:
    """Rich table on stdout."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="FAISS retriever benchmark")
    cols = ["vectors", "dim", "kind", "search", "build_s", "p50_ms", "p99_ms", f"recall@{k}"]
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(*(str(r[c]) for c in cols))
    Console(width=120).print(table)  # wide enough for every column when piped


def command(
    vectors: Annotated[str, typer.Option(help="Comma-separated sizes.")] = "10000,100000",
    dim: Annotated[int, typer.Option(help="Vector size (512 = CLIP ViT-B).")] = 512,
    queries: Annotated[int, typer.Option(help="Queries per size.")] = 200,
    k: Annotated[int, typer.Option(help="Neighbours per query (recall@k).")] = 10,
    seed: Annotated[int, typer.Option(help="Data seed.")] = 0,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write rows as JSON.")] = None,
    png: Annotated[Path | None, typer.Option("--plot", help="Write the PNG plot.")] = None,
) -> None:
    """Run the retriever benchmark: build time, latency p50/p99, recall@k of IVF/HNSW vs flat."""
    try:
        sizes = [int(v) for v in vectors.split(",") if v.strip()]
    except ValueError:
        raise typer.BadParameter(f"--vectors {vectors!r}: give e.g. 10000,100000") from None
    if not sizes or min(sizes) < 1 or dim < 2 or queries < 1 or k < 1:
        raise typer.BadParameter("sizes, --dim, --queries and --k must be positive")
    rows = [r for n in sizes for r in bench_size(n, dim, queries=queries, k=k, seed=seed)]
    print_table(rows, k)
    if json_out:
        json_out.write_text(json.dumps({"rows": rows, "queries": queries, "k": k}, indent=2))
    if png:
        plot(rows, png, k)
