"""The thin per-family layer adapter that the selective prefill drives (DESIGN.md).

Runs wherever a model runs: the reference runner (HF modules, CPU/CUDA) and the vLLM worker
(vLLM's modules). The selective prefill in `mpic.linker.selective_prefill` is written against this
protocol only, so the same code links KV for both engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class RopeSpec:
    """What the RoPE delta rotation needs to know about a model's rotary embedding.

    `mrope_section` is None for 1-D RoPE; for M-RoPE it lists how many rotary frequency pairs use
    the temporal, height and width position (Qwen2-VL: [16, 24, 24] for head size 128).
    """

    head_dim: int
    theta: float
    mrope_section: tuple[int, ...] | None = None


class LayerAdapter(Protocol):
    """A decoder seen layer by layer. S = number of tokens passed in (the recomputed ones)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeSpec
    dtype: torch.dtype
    device: torch.device

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """int64 [S] -> [S, hidden] text input embeddings."""
        ...

    def attention_inputs(
        self, layer: int, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input norm, QKV projection and RoPE at `positions` ([S] or [3, S]).

        hidden [S, hidden] -> q [S, H, D], k [S, H_kv, D] (post-RoPE), v [S, H_kv, D].
        """
        ...

    def attention_output_and_mlp(
        self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor
    ) -> torch.Tensor:
        """Output projection, residual, post-attention norm, MLP, residual.

        hidden [S, hidden] (the layer's input), attn_out [S, H, D] -> the layer's output
        [S, hidden].
        """
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: [S, hidden] -> [S, vocab] (float32)."""
        ...
