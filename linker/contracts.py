"""Contracts the linker drives: the per-family layer adapter (linker, in every process that runs a
model: the reference runner with HF modules, the vLLM worker with vLLM's modules).

The selective prefill (`mpic.linker.selective_prefill`) is written against `LayerAdapter` only, so
the same code links KV for both engines; each engine implements it beside its own model code
(`mpic.engine.hf.adapters`, `mpic.engine.vllm.connector.adapter`). The linked-KV storage contract is
`mpic.linker.kv.linked.LinkedKV`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from mpic.model_spec import RopeSpec


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
