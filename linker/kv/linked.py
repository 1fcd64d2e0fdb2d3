"""The linked KV as the selective prefill sees it (docs/design.md "Selective prefill").

Two implementations share this protocol: a dense one over [L, N, H_kv, D] tensors (reference
runner, `mpic.linker.kv.dense`) and a paged one writing into vLLM's KV blocks (vLLM worker,
`mpic.engine.vllm.connector.paged_kv`). Indices are prompt indices 0..N-1; causality is by
prompt index.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from mpic.linker.correction import LinkCorrection


class LinkedKV(Protocol):
    """Per-layer keys/values of a whole prompt: cached (rotated) KV for reused item tokens,
    dummy (zero) KV for text, overwritten by fresh KV for recomputed tokens as the pass runs."""

    def write(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite the slots `index` (int64 [S], ascending) of `layer` with k, v [S, H_kv, D]."""
        ...

    def write_layers(self, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite the slots `index` (int64 [S]) of every layer with k, v [L, S, H_kv, D]
        (linking writes all layers of all entries in one call)."""
        ...

    def read_keys(self, layer: int, index: torch.Tensor) -> torch.Tensor:
        """Keys currently linked at `index` of `layer`: [S, H_kv, D] (CacheBlend reads them)."""
        ...

    def attend(self, layer: int, q: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Attention of queries q [S, H, D] at prompt indices `index` (int64 [S], ascending) over
        every linked key of `layer` whose prompt index <= the query's: -> [S, H, D]. `index` lives
        on the KV's device; callers pass the same tensor object to every layer while the query
        set is unchanged, so an implementation may prepare its mask once."""
        ...

    def set_correction(self, correction: LinkCorrection | None) -> None:
        """From now on `attend` applies the APE-style correction of linked keys
        (`mpic.kernels.correction`; None: plain attention)."""
        ...
