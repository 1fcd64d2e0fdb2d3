"""`LayerAdapter` over the HF transformers modules of a loaded model (reference runner process,
GPU benchmarks, tests).

LLaVA, LLaVA-NeXT (Mistral/Llama backbone), Qwen2-VL, Qwen2.5-VL and the text-only Llama/Qwen2
causal LMs share the Llama/Qwen2 decoder layer layout `input_layernorm -> self_attn(q/k/v_proj,
RoPE, o_proj) -> post_attention_layernorm -> mlp`, so one class serves all; only the RoPE and
where the decoder sits differ (`model.model.language_model` for the VLMs, `model.model` for a
causal LM). 1-D RoPE (LLaVA's Llama backbone) takes positions [S]; Qwen2-VL's M-RoPE (Qwen2-VL
paper section 2.1) takes [3, S] (temporal, height, width). The cos/sin come from the model's own
`rotary_emb` (which, for Qwen2-VL / Qwen2.5-VL, interleaves the three position streams by
`mrope_section`) and are applied with the model module's own `apply_rotary_pos_emb`, so K/V
equal what the HF forward computes.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from mpic.linker.contracts import LayerAdapter
from mpic.model_spec import RopeSpec, rope_spec


class HFLayerAdapter:
    """A LLaVA, Qwen2-VL, Llama or Qwen2 HF model seen layer by layer (implements
    `LayerAdapter`)."""

    def __init__(self, model: Any) -> None:
        text_config = model.config.get_text_config()
        self._lm = getattr(model.model, "language_model", model.model)
        self._lm_head = model.lm_head
        self._layers = self._lm.layers
        attn = self._layers[0].self_attn
        self._apply_rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self.num_layers = len(self._layers)
        self.num_heads = int(text_config.num_attention_heads)
        self.num_kv_heads = int(text_config.num_key_value_heads)
        self.rope: RopeSpec = rope_spec(text_config.to_dict())
        self.head_dim = self.rope.head_dim
        self.dtype: torch.dtype = self._lm_head.weight.dtype
        self.device: torch.device = self._lm_head.weight.device
        self._positions_ndim = 1 if self.rope.mrope_section is None else 2

    @torch.inference_mode()
    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """int64 [S] -> [S, hidden] text input embeddings."""
        return self._lm.embed_tokens(token_ids.to(self.device))

    @torch.inference_mode()
    def attention_inputs(
        self, layer: int, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [S, hidden], positions [S] (1-D) or [3, S] (M-RoPE) ->
        q [S, H, D], k [S, H_kv, D] (both post-RoPE), v [S, H_kv, D]."""
        if positions.ndim != self._positions_ndim or positions.shape[-1] != hidden.shape[0]:
            raise ValueError(
                f"positions {tuple(positions.shape)} do not fit {hidden.shape[0]} tokens "
                f"(expected {'[S]' if self._positions_ndim == 1 else '[3, S]'})"
            )
        block = self._layers[layer]
        attn = block.self_attn
        seq = hidden.shape[0]
        x = block.input_layernorm(hidden)
        q = attn.q_proj(x).view(1, seq, self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(1, seq, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(x).view(seq, self.num_kv_heads, self.head_dim)
        # HF rotary modules take position ids [B, S] (1-D) or [3, B, S] (M-RoPE).
        cos, sin = self._lm.rotary_emb(x, positions.to(self.device).unsqueeze(-2))
        q, k = self._apply_rope(q, k, cos, sin, unsqueeze_dim=2)
        return q[0], k[0], v

    @torch.inference_mode()
    def attention_output_and_mlp(
        self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor
    ) -> torch.Tensor:
        """hidden [S, hidden] (layer input), attn_out [S, H, D] -> layer output [S, hidden]."""
        block = self._layers[layer]
        hidden = hidden + block.self_attn.o_proj(attn_out.reshape(hidden.shape[0], -1))
        return hidden + block.mlp(block.post_attention_layernorm(hidden))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: [S, hidden] -> [S, vocab] float32."""
        return self._lm_head(self._lm.norm(hidden)).float()


ADAPTED_MODEL_TYPES = ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "llama", "qwen2")


def make_adapter(model: Any) -> LayerAdapter:
    """The layer adapter of an HF `LlavaForConditionalGeneration`,
    `Qwen2VLForConditionalGeneration`, `LlamaForCausalLM` or `Qwen2ForCausalLM`; ValueError for
    other models."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ADAPTED_MODEL_TYPES:
        raise ValueError(
            f"no HF layer adapter for model_type {model_type!r}; "
            f"supported: {', '.join(ADAPTED_MODEL_TYPES)}"
        )
    return HFLayerAdapter(model)
