"""FAISS vector index over one dynamic-library version (MPIC section 3.1, component 4).

Runs in the CLI process (refresh, search, benchmark) and in the Serve replica that answers
retrieval. Vectors are unit rows, so inner product = cosine similarity. The default is exact
search, `IndexIDMap2(IndexFlatIP)`; large collections can use IVF (k-means cells, `nprobe`
visited per query) or HNSW (graph). Ids are int64 item ids of the dynamic-library version. The
CPU index is the one serialised to bytes (stored in the object store with each version); a GPU
copy answers searches when faiss has GPUs (flat and IVF; HNSW stays on the CPU).
"""

from __future__ import annotations

import logging
import math
from typing import Literal

import faiss
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from mpic.errors import InvalidRequestError

logger = logging.getLogger(__name__)


class IndexConfig(BaseModel):
    """Index family and its search-time knobs."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["flat", "ivf", "hnsw"] = Field("flat", description="flat = exact search.")
    nlist: int | None = Field(
        None, ge=1, description="IVF cells; None: 4*sqrt(n), capped so each cell trains on >=39."
    )
    nprobe: int = Field(16, ge=1, description="IVF cells visited per query.")
    hnsw_m: int = Field(16, ge=2, description="HNSW neighbours per node.")
    ef_construction: int = Field(40, ge=1, description="HNSW candidate list while building.")
    ef_search: int = Field(64, ge=1, description="HNSW candidate list while searching.")
    use_gpu: Literal["auto", "never"] = Field("auto", description="auto: GPU copy when present.")


def _nlist(cfg: IndexConfig, n: int) -> int:
    if cfg.nlist is not None:
        return cfg.nlist
    return max(1, min(int(4 * math.sqrt(n)), n // 39))


class VectorIndex:
    """Unit vectors with int64 ids; `search` returns inner-product scores, best first."""

    def __init__(self, index: faiss.Index, cfg: IndexConfig):
        self.cfg = cfg
        self.cpu_index = index
        self._apply_search_params(index)
        self._search_index = self._gpu_copy(index) if cfg.use_gpu == "auto" else index

    @classmethod
    def build(cls, vectors: np.ndarray, ids: np.ndarray, cfg: IndexConfig) -> VectorIndex:
        """vectors float32 [n, d] (unit rows), ids int64 [n] (distinct) -> index."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if vectors.ndim != 2 or ids.shape != (vectors.shape[0],):
            raise InvalidRequestError(f"vectors {vectors.shape} and ids {ids.shape} disagree")
        n, dim = vectors.shape
        base: faiss.Index
        if cfg.kind == "ivf":
            quantizer = faiss.IndexFlatIP(dim)
            base = faiss.IndexIVFFlat(quantizer, dim, _nlist(cfg, n), faiss.METRIC_INNER_PRODUCT)
            base.train(vectors)
            base.make_direct_map()  # `reconstruct` by id
        elif cfg.kind == "hnsw":
            hnsw = faiss.IndexHNSWFlat(dim, cfg.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            hnsw.hnsw.efConstruction = cfg.ef_construction
            base = hnsw
        else:
            base = faiss.IndexFlatIP(dim)
        index = faiss.IndexIDMap2(base)  # faiss's Python layer keeps `base` alive
        if n:
            index.add_with_ids(vectors, ids)
        return cls(index, cfg)

    @classmethod
    def from_bytes(cls, data: bytes, cfg: IndexConfig) -> VectorIndex:
        """Inverse of `to_bytes` (faiss.deserialize_index)."""
        return cls(faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8)), cfg)

    def to_bytes(self) -> bytes:
        """The CPU index as bytes (faiss.serialize_index), for the object store."""
        return faiss.serialize_index(self.cpu_index).tobytes()

    @property
    def dim(self) -> int:
        """d, the vector size."""
        return int(self.cpu_index.d)

    @property
    def ntotal(self) -> int:
        """Number of vectors held."""
        return int(self.cpu_index.ntotal)

    def reconstruct(self, item_id: int) -> np.ndarray:
        """The stored vector of `item_id`, float32 [d] (reused by incremental refresh)."""
        return np.asarray(self.cpu_index.reconstruct(int(item_id)), dtype=np.float32)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """queries float32 [q, d] -> (scores float32 [q, k'], ids int64 [q, k']), best first.

        k' = min(k, ntotal); slots an approximate index could not fill have id -1.
        """
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise InvalidRequestError(f"query shape {queries.shape}, index dim {self.dim}")
        if k < 1:
            raise InvalidRequestError("top_k must be >= 1", param="top_k")
        k = min(k, self.ntotal)
        if k == 0:
            empty = np.zeros((queries.shape[0], 0))
            return empty.astype(np.float32), empty.astype(np.int64)
        scores, ids = self._search_index.search(queries, k)
        return scores, ids

    def _apply_search_params(self, index: faiss.Index) -> None:
        base = faiss.downcast_index(index.index) if isinstance(index, faiss.IndexIDMap2) else index
        if isinstance(base, faiss.IndexIVF):
            base.nprobe = self.cfg.nprobe
        elif isinstance(base, faiss.IndexHNSW):
            base.hnsw.efSearch = self.cfg.ef_search

    def _gpu_copy(self, index: faiss.Index) -> faiss.Index:
        if self.cfg.kind == "hnsw" or not hasattr(faiss, "StandardGpuResources"):
            return index
        if faiss.get_num_gpus() == 0:
            return index
        self._gpu_resources = faiss.StandardGpuResources()
        logger.info("FAISS %s index on GPU", self.cfg.kind)
        return faiss.index_cpu_to_gpu(self._gpu_resources, 0, index)
