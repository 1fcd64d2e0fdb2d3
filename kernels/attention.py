"""Selective attention: the recomputed queries of a layer over the linked keys, with the exact
causal mask by prompt index (kernels; runs wherever a model runs: reference runner, vLLM worker,
entry computation).

This is the core of MPIC's selective attention (paper section 4.1, Fig. 7): only the S recomputed
tokens issue queries, but they attend over all N linked keys (cached, rotated item KV plus fresh
KV of recomputed tokens). The query at prompt index i sees the key at index j iff j <= i.
Grouped-query attention (H query heads sharing H_kv KV heads) is supported by every backend.

The seam: one abstract `AttentionBackend` (`mpic.kernels.attention_backend`, which the
backends import: no import circle), one module per backend (as LMCache's
`v1/compute/attention`), picked by name (`get_backend`):

- `sdpa_runs` (`mpic.kernels.sdpa_runs`): one SDPA call per contiguous run of queries with a mask
  of the run's own size. The test oracle, and the CPU default (fastest eager path there).
- `flex` (`mpic.kernels.flex`): ONE FlexAttention call per layer over all S queries with a block
  mask `kv_idx <= q_index[q_idx]` built once per request and shared by all layers; compiled on
  CUDA (the CUDA default), eager on CPU.

A backend splits the work in two: `prepare` (once per set of active queries: runs, masks, the
key bound; `sdpa_runs` reads the indices on the host once, `flex` reads device indices never)
and `attend` (per layer; no host syncs).
`SelectiveAttention` holds one request's prepared state and rebuilds it only when the caller
passes a different query-index tensor object, so layers that share an index share the mask.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from mpic.kernels.attention_backend import AttentionBackend

BACKENDS: tuple[str, ...] = ("sdpa_runs", "flex")
"""Backend names `get_backend` accepts."""

BACKEND_ENV = "MPIC_ATTENTION_BACKEND"
"""Environment variable that overrides the default backend (one of `BACKENDS`)."""


def get_backend(name: str) -> AttentionBackend:
    """The backend called `name`; ValueError listing the valid names otherwise."""
    if name == "sdpa_runs":
        from mpic.kernels.sdpa_runs import SdpaRunsBackend

        return SdpaRunsBackend()
    if name == "flex":
        from mpic.kernels.flex import FlexBackend

        return FlexBackend()
    raise ValueError(f"unknown attention backend {name!r}; valid: {', '.join(BACKENDS)}")


def default_backend_name(device: torch.device | str) -> str:
    """`$MPIC_ATTENTION_BACKEND` if set, else `flex` on CUDA and `sdpa_runs` elsewhere (eager
    FlexAttention materialises the whole S x N score matrix and is slower on CPU)."""
    chosen = os.environ.get(BACKEND_ENV)
    if chosen:
        if chosen not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV}={chosen!r}; valid: {', '.join(BACKENDS)}")
        return chosen
    return "flex" if torch.device(device).type == "cuda" else "sdpa_runs"


class SelectiveAttention:
    """One request's attention: a backend plus the state prepared for the current queries."""

    def __init__(self, backend: AttentionBackend | str) -> None:
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self._index: torch.Tensor | None = None
        self._num_keys = -1
        self._state: Any = None
        self._corrected: tuple[torch.Tensor, torch.Tensor, int, Any] | None = None

    def __call__(
        self,
        q: torch.Tensor,
        q_index: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        scale: float | None = None,
        linked: torch.Tensor | None = None,
        s: float = 1.0,
    ) -> torch.Tensor:
        """See `AttentionBackend.attend`; `q_index` int64 [S] ascending on the keys' device.
        With `linked` (bool [N]) and s != 1: `AttentionBackend.attend_corrected`. Each state is
        prepared when first needed: a pass whose every layer is corrected (`auto`) builds no
        plain mask."""
        num_keys = int(keys.shape[0])
        fresh = q_index is self._index and num_keys == self._num_keys
        if linked is not None and s != 1.0:
            held = self._corrected
            stale = held is None or held[0] is not q_index or held[1] is not linked
            if stale or held[2] != num_keys:
                prepared = self.backend.prepare_corrected(q_index, linked, num_keys)
                held = (q_index, linked, num_keys, prepared)
                self._corrected = held
            plain = self._state if fresh else None  # the backends' corrected paths ignore it
            return self.backend.attend_corrected(
                plain, q, q_index, keys, values, linked, s, scale, held[3]
            )
        if not fresh:
            self._state = self.backend.prepare(q_index, num_keys)
            self._index, self._num_keys = q_index, num_keys
        return self.backend.attend(self._state, q, keys, values, scale)


def selected_attention(
    q: torch.Tensor,
    q_index: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float | None = None,
    backend: str = "sdpa_runs",
) -> torch.Tensor:
    """One-off causal attention of selected queries over linked keys (prepare + attend).

    q: [S, H, D] queries at prompt indices `q_index` (int64 [S], ascending); keys, values:
    [N, H_kv, D]; returns [S, H, D] in q's dtype.
    """
    impl = get_backend(backend)
    q_index = q_index.to(keys.device)
    return impl.attend(impl.prepare(q_index, int(keys.shape[0])), q, keys, values, scale)
