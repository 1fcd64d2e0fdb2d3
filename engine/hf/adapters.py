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

The layer step is compiled on CUDA (`compile`): the two halves of a decoder layer around the
attention (input norm, QKV projections and RoPE; output projection, residuals, post-attention
norm and MLP) are two module-level functions compiled once by `mpic.kernels.compiled` (dynamic
token count; the layer's module is an argument, so all layers share one graph per half and
dynamo reads their weights as inputs): a few fused kernels per half instead of ~50 launches,
the host work that left the GPU idle in the selective pass. RoPE cos/sin are computed once per
position set, as the HF forward does. `MPIC_COMPILE_LAYERS=0|1` overrides the default.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from mpic.kernels.compiled import compiled
from mpic.linker.contracts import LayerAdapter
from mpic.model_spec import RopeSpec, rope_spec

COMPILE_ENV = "MPIC_COMPILE_LAYERS"
"""Environment variable: 1 compiles the layer step, 0 keeps it eager (default: on CUDA only)."""


def _attention_inputs_step(
    block: Any,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    apply_rope: Any,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input norm, QKV projections, RoPE of one decoder layer `block`: hidden [S, hidden],
    cos/sin [1, S, D] -> q [S, H, D], k [S, H_kv, D] (post-RoPE), v [S, H_kv, D]."""
    attn = block.self_attn
    seq = hidden.shape[0]
    x = block.input_layernorm(hidden)
    q = attn.q_proj(x).view(1, seq, heads, head_dim)
    k = attn.k_proj(x).view(1, seq, kv_heads, head_dim)
    v = attn.v_proj(x).view(seq, kv_heads, head_dim)
    q, k = apply_rope(q, k, cos, sin, unsqueeze_dim=2)
    return q[0], k[0], v


def _output_and_mlp_step(block: Any, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    """Output projection, residual, post-attention norm, MLP, residual of decoder layer `block`:
    hidden [S, hidden] (the layer's input), attn_out [S, H, D] -> [S, hidden]."""
    hidden = hidden + block.self_attn.o_proj(attn_out.reshape(hidden.shape[0], -1))
    return hidden + block.mlp(block.post_attention_layernorm(hidden))


def compile_default(device: torch.device) -> bool:
    """`$MPIC_COMPILE_LAYERS` if set (1/0), else True on CUDA (where launches and host work,
    not arithmetic, bound the selective pass), False elsewhere."""
    chosen = os.environ.get(COMPILE_ENV)
    if chosen:
        if chosen not in ("0", "1"):
            raise ValueError(f"{COMPILE_ENV}={chosen!r}; valid: 0, 1")
        return chosen == "1"
    return device.type == "cuda"


class HFLayerAdapter:
    """A LLaVA, Qwen2-VL, Llama or Qwen2 HF model seen layer by layer (implements
    `LayerAdapter`).

    compile: compile the layer step (None: `compile_default`); compile_backend: dynamo's
    backend for it (`inductor`; `aot_eager` exercises the compiled path on the CPU quickly).
    A compile that fails makes the step eager for the process, with one warning."""

    def __init__(
        self, model: Any, compile: bool | None = None, compile_backend: str = "inductor"
    ) -> None:
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
        self._rope_held: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None
        """(positions, their cos/sin): the last position set's (`_cos_sin`)."""
        self.compiled = compile_default(self.device) if compile is None else compile
        """Whether the layer step runs compiled."""
        self._inputs_step: Any = _attention_inputs_step
        self._output_step: Any = _output_and_mlp_step
        if self.compiled:
            self._inputs_step = compiled(_attention_inputs_step, compile_backend, on_error="eager")
            self._output_step = compiled(_output_and_mlp_step, compile_backend, on_error="eager")

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
        cos, sin = self._cos_sin(hidden, positions)
        return self._inputs_step(
            self._layers[layer],
            hidden,
            cos,
            sin,
            self._apply_rope,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        )

    def _cos_sin(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's RoPE cos/sin [1, S, D] of `positions`, computed once per positions tensor
        object: the selective pass hands every layer the same object until its token set
        changes (as an HF forward computes them once for all layers), so the rotary module's
        ~15 ops run once per set, not per layer."""
        held = self._rope_held
        if held is not None and held[0] is positions:
            return held[1]
        # HF rotary modules take position ids [B, S] (1-D) or [3, B, S] (M-RoPE).
        cos_sin = self._lm.rotary_emb(x, positions.to(self.device).unsqueeze(-2))
        self._rope_held = (positions, cos_sin)
        return cos_sin

    @torch.inference_mode()
    def attention_output_and_mlp(
        self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor
    ) -> torch.Tensor:
        """hidden [S, hidden] (layer input), attn_out [S, H, D] -> layer output [S, hidden]."""
        # contiguous: backends return either layout, and a compiled step guards on strides
        return self._output_step(self._layers[layer], hidden, attn_out.contiguous())

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: [S, hidden] -> [S, vocab] float32."""
        return self._lm_head(self._lm.norm(hidden)).float()


ADAPTED_MODEL_TYPES = ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "llama", "qwen2")


def make_adapter(
    model: Any, compile: bool | None = None, compile_backend: str = "inductor"
) -> LayerAdapter:
    """The layer adapter of an HF `LlavaForConditionalGeneration`,
    `Qwen2VLForConditionalGeneration`, `LlamaForCausalLM` or `Qwen2ForCausalLM` (compile: the
    layer step's, see `HFLayerAdapter`); ValueError for other models."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ADAPTED_MODEL_TYPES:
        raise ValueError(
            f"no HF layer adapter for model_type {model_type!r}; "
            f"supported: {', '.join(ADAPTED_MODEL_TYPES)}"
        )
    return HFLayerAdapter(model, compile, compile_backend)
