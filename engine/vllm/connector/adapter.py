"""LayerAdapter over vLLM's own decoder modules (runs in the vLLM worker process).

The selective prefill (docs/design.md "Selective prefill") drives a model layer by layer through
`mpic.linker.contracts.LayerAdapter`. Here the layers are vLLM's: its fused QKV projection, rotary
embedding (1-D RoPE for LLaVA's Llama backbone, M-RoPE for Qwen2-VL's Qwen2 backbone), RMSNorms,
o_proj and gated MLP, so linked K/V match what vLLM itself computes (docs/vllm.md).
Both families share the Llama/Qwen2 decoder layer layout: `input_layernorm -> self_attn(qkv_proj,
rotary_emb, attn, o_proj) -> post_attention_layernorm -> mlp`.

The adapter carries the full residual stream `hidden` between layers and adds residuals itself:
vLLM's fused "add + RMSNorm" (residual kept apart, possibly in place) computes the same sums.

On the CPU the RMSNorms run vLLM's fused CPU kernel (`torch.ops._C.rms_norm`) and the gated MLP's
SiLU multiplies in place: vLLM's eager CPU forward runs its norms' native torch recipe (seven
unfused passes over the rows), about 7% of a batched link pass of 16 small-LLaVA prompts
(3.3 vs 0.23 ms a norm at 2,400 rows x 512, 2 threads). The values agree to float32
rounding (2e-6 at unit scale); elsewhere the modules run as vLLM's forward runs them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.linear import UnquantizedLinearMethod

from mpic.model_spec import RopeSpec


def language_model(model: nn.Module) -> nn.Module:
    """The `*ForCausalLM` inside a vLLM multimodal model (or the model itself for text)."""
    return getattr(model, "language_model", model)


class VllmLayerAdapter:
    """`LayerAdapter` over a loaded vLLM model (LLaVA, Qwen2-VL, or a text Llama/Qwen2)."""

    def __init__(self, model: nn.Module) -> None:
        self._lm = language_model(model)
        self._layers = self._lm.model.layers
        attn = self._layers[0].self_attn
        self.num_layers = len(self._layers)
        self.num_heads = int(attn.num_heads)
        self.num_kv_heads = int(attn.num_kv_heads)
        self.head_dim = int(attn.head_dim)
        rotary = attn.rotary_emb
        section = getattr(rotary, "mrope_section", None)
        self.rope = RopeSpec(
            head_dim=int(rotary.head_size),
            theta=float(rotary.base),
            mrope_section=tuple(int(s) for s in section) if section else None,
        )
        weight = self._lm.model.embed_tokens.weight
        self.dtype = weight.dtype
        self.device = weight.device
        # the CPU with vLLM's CPU kernels: the norms and the MLP's product take the shortcuts
        self._fused_cpu = self.device.type == "cpu" and hasattr(torch.ops._C, "rms_norm")

    def attention_layer(self, layer: int) -> nn.Module:
        """vLLM's `Attention` module of `layer` (owns `layer_name`, `isa`, scales, `impl`)."""
        return self._layers[layer].self_attn.attn

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """int64 [S] -> [S, hidden] text input embeddings."""
        return self._lm.model.embed_tokens(token_ids.to(self.device))

    def attention_inputs(
        self, layer: int, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [S, hidden], positions [S] or [3, S] -> q [S, H, D], k, v [S, H_kv, D]."""
        block = self._layers[layer]
        attn = block.self_attn
        x = self._norm(block.input_layernorm, hidden)
        qkv, _ = attn.qkv_proj(x)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = attn.rotary_emb(positions.to(self.device), q, k)
        s = hidden.shape[0]
        return (
            q.reshape(s, self.num_heads, self.head_dim),
            k.reshape(s, self.num_kv_heads, self.head_dim),
            v.reshape(s, self.num_kv_heads, self.head_dim),
        )

    def attention_output_and_mlp(
        self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor
    ) -> torch.Tensor:
        """hidden [S, hidden] (layer input), attn_out [S, H, D] -> layer output [S, hidden]."""
        block = self._layers[layer]
        out, _ = block.self_attn.o_proj(attn_out.reshape(hidden.shape[0], -1))
        residual = hidden + out  # vLLM's fused add+norm may work in place: keep `hidden` intact
        return self._mlp(block.mlp, self._norm(block.post_attention_layernorm, residual)) + residual

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, hidden] -> [S, vocab] float32 (final norm, LM head, vLLM's logits processor)."""
        x = self._norm(self._lm.model.norm, hidden)
        return self._lm.logits_processor(self._lm.lm_head, x).float()

    def _norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """vLLM's `RMSNorm` of x [S, hidden]: `cpu_rms_norm` on the CPU, else the module."""
        return cpu_rms_norm(norm, x) if self._fused_cpu else norm(x)

    def _mlp(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """vLLM's gated MLP of x [S, hidden]: `cpu_gated_mlp` on the CPU, else the module."""
        return cpu_gated_mlp(mlp, x) if self._fused_cpu else mlp(x)


def cpu_rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """vLLM's `RMSNorm` module `norm` applied to x [S, hidden] through vLLM's fused CPU kernel
    (one pass over the rows instead of the native recipe's seven); a norm over part of the row
    or without a weight runs as the module."""
    if norm.variance_size_override is not None or not norm.has_weight:
        return norm(x)
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x.contiguous(), norm.weight.data, norm.variance_epsilon)
    return out


def cpu_gated_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """vLLM's gated MLP module `mlp` (Llama / Qwen2: gate_up_proj, act_fn, down_proj) applied to
    x [S, hidden] -> [S, hidden] = down(silu(gate) * up), the product taken in place: the values
    of vLLM's `SiluAndMul` with one allocation fewer. Another activation, or a quantized
    `down_proj` (vLLM may fuse its input quantization into the activation), runs as the module."""
    plain = isinstance(getattr(mlp.down_proj, "quant_method", None), UnquantizedLinearMethod)
    if not isinstance(mlp.act_fn, SiluAndMul) or not plain:
        return mlp(x)
    gate_up, _ = mlp.gate_up_proj(x)
    half = gate_up.shape[-1] // 2
    out, _ = mlp.down_proj(F.silu(gate_up[:, :half]).mul_(gate_up[:, half:]))
    return out
