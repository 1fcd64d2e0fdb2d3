"""RoPE oracles: our angles match transformers' Llama and Qwen2-VL rotary embeddings; rotating
a -> b -> a returns the keys; rotating to b equals computing at b (1-D and M-RoPE)."""

import pytest
import torch
from transformers import LlamaConfig, Qwen2VLConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

from mpic.kernels.rope import apply_rotation, rope_angles, rotate_keys
from mpic.model_spec import RopeSpec

D = 32
ROPE_1D = RopeSpec(head_dim=D, theta=10000.0)
ROPE_M = RopeSpec(head_dim=D, theta=10000.0, mrope_section=(4, 6, 6))


def _positions(mrope: bool, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 500, (3, n) if mrope else (n,), generator=g)


def test_1d_matches_llama_rotary():
    cfg = LlamaConfig(hidden_size=D * 2, num_attention_heads=2, rope_theta=10000.0)
    pos = torch.arange(0, 300, 7)
    x = torch.randn(pos.numel(), 2, D)
    cos, sin = LlamaRotaryEmbedding(cfg)(x, pos[None])
    hf, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    ours = apply_rotation(x, rope_angles(pos, ROPE_1D))
    torch.testing.assert_close(ours, hf[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_mrope_matches_qwen2vl_rotary():
    cfg = Qwen2VLConfig(
        text_config=dict(
            hidden_size=D * 2,
            num_attention_heads=2,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [4, 6, 6],
            },
        )
    )
    rotary = Qwen2VLRotaryEmbedding(cfg.text_config)
    pos = _positions(True, 40, 0)
    x = torch.randn(40, 2, D)
    cos, sin = rotary(x, pos[:, None, :])
    hf, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    ours = apply_rotation(x, rope_angles(pos, ROPE_M))
    torch.testing.assert_close(ours, hf[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rope", [ROPE_1D, ROPE_M], ids=["1d", "mrope"])
def test_rotate_there_and_back_and_equals_computing_there(rope):
    mrope = rope.mrope_section is not None
    a, b = _positions(mrope, 50, 1), _positions(mrope, 50, 2)
    raw = torch.randn(4, 50, 2, D)  # [L, S, H_kv, D] pre-RoPE keys of context-free tokens
    at_a = apply_rotation(raw, rope_angles(a, rope))
    at_b = apply_rotation(raw, rope_angles(b, rope))
    moved = rotate_keys(at_a, a, b, rope)
    torch.testing.assert_close(moved, at_b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rotate_keys(moved, b, a, rope), at_a, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(moved, at_a, atol=1e-2)


def test_zero_delta_is_bit_exact():
    pos = _positions(True, 10, 3)
    keys = torch.randn(2, 10, 2, D, dtype=torch.bfloat16)
    assert rotate_keys(keys, pos, pos, ROPE_M) is keys
    mixed = pos.clone()
    mixed[:, :5] += 3
    out = rotate_keys(keys, pos, mixed, ROPE_M)
    assert torch.equal(out[:, 5:], keys[:, 5:])


@pytest.mark.parametrize("rope", [ROPE_1D, ROPE_M], ids=["1d", "mrope"])
def test_rotation_follows_the_keys_device(rope):
    """Plan positions are host tensors; keys may live elsewhere (CUDA in the reference runner;
    the meta device here stands for any other device): the result stays with the keys."""
    keys = torch.empty(3, 5, 2, rope.head_dim, device="meta")
    old = torch.arange(5) if rope.mrope_section is None else torch.arange(5).expand(3, 5)
    out = rotate_keys(keys, old, old + 7, rope)
    assert out.device.type == "meta" and out.shape == keys.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_rotation_bit_identical_to_the_rotate_half_formula(dtype):
    """The half-by-half rotation (no float32 copy, no rotate-half cat) equals, bit for bit,
    x.float() * cat(cos, cos) + rotate_half(x.float()) * cat(sin, sin) cast back, with leading
    (layer) dims and a strided input."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 37, 4, D, generator=g) * 3).to(dtype)
    angles = torch.randn(37, D // 2, generator=g) * 1000
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, None, :]
    for xs in (x, x.transpose(1, 2).contiguous().transpose(1, 2)):
        xf = xs.float()
        half = torch.cat([-xf[..., D // 2 :], xf[..., : D // 2]], dim=-1)
        want = (xf * cos + half * sin).to(dtype)
        got = apply_rotation(xs, angles)
        assert got.dtype == dtype
        assert torch.equal(got, want)
