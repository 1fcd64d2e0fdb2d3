"""Several prompts' linked KVs as one (linker; the one link pass over a batch of requests,
`mpic.linker.pipeline.link_pass`: the reference runner's batch of one needs none, the vLLM
worker's batched pass uses its own subclass, `mpic.engine.vllm.connector.batched_link`).

The requests are laid out one after the other: request r's prompt index p is the global index
`offsets[r] + p`. A layer's rows (ascending global indices) are cut where the request changes
and each request's rows go to its own linked KV with its own prompt indices, so each query
attends exactly over its own request's keys up to its own index (the mask of a one-request
pass) and the linked-key correction each request's KV carries applies to its rows alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpic.linker.kv.linked import LinkedKV


class StackedLinkedKV:
    """`LinkedKV` over several requests' own linked KVs (module docstring).

    kvs: the requests' linked KVs in batch order; sizes: their prompt lengths (N_r)."""

    def __init__(self, kvs: Sequence[LinkedKV], sizes: Sequence[int]) -> None:
        if len(kvs) != len(sizes):
            raise ValueError(f"{len(kvs)} linked KVs for {len(sizes)} prompt lengths")
        self._kvs = list(kvs)
        self.offsets = torch.tensor([0, *sizes], dtype=torch.int64).cumsum(0)
        """int64 [R + 1]: offsets[r] is request r's first global index, offsets[R] the total."""
        self.total = int(self.offsets[-1])
        self._req = torch.repeat_interleave(
            torch.arange(len(sizes)), torch.tensor(list(sizes), dtype=torch.int64)
        )
        self._split: tuple[torch.Tensor, list[tuple[int, int, int, torch.Tensor]]] | None = None
        """(the global index object last split, [(a, b, r, request r's local index)])."""

    def _requests(self, index: torch.Tensor) -> list[tuple[int, int, int]]:
        """Rows [a, b) of `index` (ascending global indices) that belong to request r, one
        range per request present: [(a, b, r)] (a request's rows are contiguous, requests being
        laid out in order)."""
        return self._ranges(index, contiguous=False)

    def _ranges(self, index: torch.Tensor, contiguous: bool) -> list[tuple[int, int, int]]:
        """Rows of `index` cut where the request changes (and, with `contiguous`, where the
        global indices jump)."""
        host = index.cpu()
        if host.numel() == 0:
            return []
        req = self._req[host]
        cut = req[1:] != req[:-1]
        if contiguous:
            cut |= host[1:] != host[:-1] + 1
        breaks = torch.nonzero(cut).flatten() + 1
        edges = [0, *breaks.tolist(), int(host.shape[0])]
        return [(a, b, int(req[a])) for a, b in zip(edges[:-1], edges[1:], strict=False)]

    def by_request(self, index: torch.Tensor) -> list[tuple[int, int, int, torch.Tensor]]:
        """`_requests(index)` with each request's local index, computed once per index object:
        `run_layers` hands the same object to every layer until the active set changes, and a
        request's attention keeps its prepared masks while it gets the same local object."""
        if self._split is None or self._split[0] is not index:
            split = [
                (a, b, r, index[a:b] - int(self.offsets[r])) for a, b, r in self._requests(index)
            ]
            self._split = (index, split)
        return self._split[1]

    def write(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite global indices `index` [S] of `layer` with k, v [S, H_kv, D]."""
        for a, b, r, local in self.by_request(index):
            self._kvs[r].write(layer, local, k[a:b], v[a:b])

    def write_layers(self, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite global indices `index` [S] of every layer with k, v [L, S, H_kv, D]."""
        for a, b, r in self._requests(index):
            local = index[a:b] - int(self.offsets[r])
            self._kvs[r].write_layers(local, k[:, a:b], v[:, a:b])

    def read_keys(self, layer: int, index: torch.Tensor) -> torch.Tensor:
        """Keys linked at global indices `index` of `layer`: [S, H_kv, D]."""
        parts = [self._kvs[r].read_keys(layer, local) for _, _, r, local in self.by_request(index)]
        return torch.cat(parts)

    def set_correction(self, correction: object) -> None:
        """A correction belongs to one request's prompt: set it on that request's own KV."""
        raise NotImplementedError("set the linked-key correction on each request's own KV")

    def attend(self, layer: int, q: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """q [S, H, D] at ascending global indices -> [S, H, D], each row over its own
        request's keys [0, p] (one call per request present; their outputs joined by one
        `cat`, none for a single request)."""
        parts = [
            self._kvs[r].attend(layer, q[a:b], local) for a, b, r, local in self.by_request(index)
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts)
