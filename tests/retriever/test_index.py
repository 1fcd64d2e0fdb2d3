"""FAISS index: exact flat search vs brute force, approximate kinds, bytes round trip."""

from __future__ import annotations

import numpy as np
import pytest

from mpic.benchmarks.retriever import clustered_unit_vectors, recall_at_k
from mpic.errors import InvalidRequestError
from mpic.retriever.index import IndexConfig, VectorIndex


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    _, x = clustered_unit_vectors(3000, 32, clusters=30, spread=1.0, seed=0)
    ids = np.arange(3000, dtype=np.int64) * 1_000_003 + 17  # sparse 64-bit ids
    return x[:2900], ids[:2900], x[2900:]


def test_flat_equals_brute_force(data) -> None:
    x, ids, q = data
    scores, found = VectorIndex.build(x, ids, IndexConfig()).search(q, 10)
    sims = q @ x.T
    order = np.argsort(-sims, axis=1)[:, :10]
    np.testing.assert_array_equal(found, ids[order])
    np.testing.assert_allclose(scores, np.take_along_axis(sims, order, 1), atol=1e-5)


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_kinds_round_trip_through_bytes(data, kind: str) -> None:
    x, ids, q = data
    cfg = IndexConfig(kind=kind)
    index = VectorIndex.build(x, ids, cfg)
    _, truth = VectorIndex.build(x, ids, IndexConfig()).search(q, 10)
    scores, found = index.search(q, 10)
    assert recall_at_k(found, truth) >= 0.9
    _, self_hit = index.search(x[:50], 1)
    np.testing.assert_array_equal(self_hit[:, 0], ids[:50])
    again = VectorIndex.from_bytes(index.to_bytes(), cfg)
    assert again.ntotal == len(ids) and again.dim == 32
    s2, f2 = again.search(q, 10)
    np.testing.assert_array_equal(f2, found)
    np.testing.assert_allclose(s2, scores)
    np.testing.assert_allclose(again.reconstruct(int(ids[7])), x[7], atol=1e-6)


def test_edges_and_bad_input(data) -> None:
    x, ids, q = data
    small = VectorIndex.build(x[:3], ids[:3], IndexConfig())
    scores, found = small.search(q[:2], 10)
    assert found.shape == (2, 3) and set(found[0]) == set(ids[:3])
    empty = VectorIndex.build(x[:0], ids[:0], IndexConfig())
    assert empty.search(q[:2], 5)[1].shape == (2, 0)
    with pytest.raises(InvalidRequestError):
        small.search(q[:, :16], 1)
    with pytest.raises(InvalidRequestError):
        small.search(q, 0)
    with pytest.raises(InvalidRequestError):
        VectorIndex.build(x[:3], ids[:2], IndexConfig())
