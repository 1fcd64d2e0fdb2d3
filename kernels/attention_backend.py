"""The attention-backend interface (kernels; runs wherever a model runs): causal-by-prompt-index
attention of the S recomputed queries over the N linked keys (MPIC section 4.1). One module per
backend implements it (`sdpa_runs`, `flex`); `mpic.kernels.attention` picks one by name and
holds a request's prepared state. The backends import this module, never `attention`, so the
picker and the backends form no import circle.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch


class AttentionBackend(ABC):
    """Causal-by-prompt-index attention of selected queries over linked keys."""

    name: ClassVar[str]

    @abstractmethod
    def prepare(self, q_index: torch.Tensor, num_keys: int) -> Any:
        """State for queries at prompt indices `q_index` (int64 [S], ascending, on the keys'
        device) over `num_keys` linked keys: built once, reused by every layer."""

    @abstractmethod
    def attend(
        self,
        state: Any,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        scale: float | None = None,
    ) -> torch.Tensor:
        """q [S, H, D], keys/values [N, H_kv, D] indexed by prompt index (H % H_kv == 0),
        scale (default D ** -0.5) -> [S, H, D] in q's dtype. No host<->device syncs."""

    def prepare_corrected(self, q_index: torch.Tensor, linked: torch.Tensor, num_keys: int) -> Any:
        """State for `attend_corrected` of one query set and one linked set (bool [N]), built
        once and reused by every layer with both. Default: `mpic.kernels.correction`'s."""
        from mpic.kernels.correction import prepare_corrected

        return prepare_corrected(q_index, linked, num_keys)

    def attend_corrected(
        self,
        state: Any,
        q: torch.Tensor,
        q_index: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        linked: torch.Tensor,
        s: float,
        scale: float | None = None,
        corrected_state: Any = None,
    ) -> torch.Tensor:
        """`attend` with the APE-style correction (`mpic.kernels.correction`): the log-sum-exp
        of each query's attention over the `linked` keys (bool [N]) multiplied by `s` before
        merging with the rest. Default: the torch path (materialised scores per query chunk);
        `corrected_state` from `prepare_corrected`, kept by `SelectiveAttention` across layers;
        `state` (`prepare`'s) may be None: `SelectiveAttention` prepares it only for plain
        layers."""
        from mpic.kernels.correction import corrected_attention

        return corrected_attention(q, q_index, keys, values, linked, s, scale, corrected_state)
