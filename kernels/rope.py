"""RoPE angles and the delta rotation of cached keys (torch reference; runs wherever a model runs:
reference runner, vLLM worker, entry computation).

Cached keys are stored AFTER RoPE at their canonical positions (mpic/types.py). RoPE rotates each
frequency pair j of a head by the angle p * inv_freq[j], and rotations compose, so a key cached at
p_old is moved to p_new by rotating it once more by (p_new - p_old) * inv_freq[j] (LMCache's
scheme, docs/design.md "Cache entry"). For M-RoPE (Qwen2-VL) the pairs are split into sections
(`mrope_section`, e.g. [16, 24, 24]) that use the temporal, height and width position
respectively (transformers' `Qwen2VLRotaryEmbedding.recomposition_frequencies`).

The layout is HF's "rotate_half" layout: pair j is (x[j], x[j + D/2]).
"""

from __future__ import annotations

import torch

from mpic.model_spec import RopeSpec


def inverse_frequencies(rope: RopeSpec, device: torch.device | None = None) -> torch.Tensor:
    """float32 [D/2]: inv_freq[j] = theta^(-2j/D) (RoFormer Eq. 15, HF default rope)."""
    exponents = torch.arange(0, rope.head_dim, 2, dtype=torch.float32, device=device)
    return 1.0 / (rope.theta ** (exponents / rope.head_dim))


def rope_angles(positions: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """Rotation angle of every frequency pair for every token.

    positions: int64 [S] (1-D RoPE) or [3, S] (M-RoPE: t, h, w; also accepted for 1-D models
    when all three rows are equal). Returns float32 [S, D/2].
    """
    inv_freq = inverse_frequencies(rope, positions.device)
    if rope.mrope_section is None:
        if positions.dim() == 2:
            positions = positions[0]
        return positions.to(torch.float32)[:, None] * inv_freq[None, :]
    if positions.dim() == 1:
        positions = positions.expand(3, -1)
    assert sum(rope.mrope_section) == rope.head_dim // 2, "mrope_section must cover D/2 pairs"
    # the section of each pair, from the spec's plain ints: no tensor op on the host (a host
    # repeat_interleave took 5 ms a request on an H200 machine's 16 threads) and no device sync
    sections = [row for row, pairs in enumerate(rope.mrope_section) for _ in range(pairs)]
    section_of_pair = torch.tensor(sections, device=positions.device)
    # pair j uses the position row section_of_pair[j]: [S, D/2]
    chosen = positions.to(torch.float32).index_select(0, section_of_pair).transpose(0, 1)
    return chosen * inv_freq[None, :]


def apply_rotation(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., S, H, D] by angles [S, D/2] (rotate_half layout; leading dims such as
    layers broadcast). Computed in float32 and returned in x's dtype.

    Per pair (x1, x2) = (x[j], x[j + D/2]): (x1 cos - x2 sin, x2 cos + x1 sin), each half
    written into the output as it is computed (rounded to x's dtype on the write): no float32
    copy of x (a 16-bit x is promoted exactly inside each multiply by the float32 cos/sin), no
    rotate-half copy, no cat, no separate cast of the result: on all layers of a request's
    linked keys, 6 half-size kernels instead of 7 full-size ones and no float32 copy of them.
    Bit-identical to `x.float() * cat(cos, cos) + rotate_half(x.float()) * cat(sin, sin)` cast
    back (a + (-b) is a - b exactly)."""
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]  # [S, 1, D/2]
    low = (torch.float32, torch.bfloat16, torch.float16)
    xf = x if x.dtype in low else x.to(torch.float32)  # float64 and others: to float32 first
    half = xf.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.empty(xf.shape, dtype=x.dtype, device=x.device)
    torch.sub(x1 * cos, x2 * sin, out=out[..., :half])
    torch.add(x2 * cos, x1 * sin, out=out[..., half:])
    return out


def rotate_keys(
    keys: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor, rope: RopeSpec
) -> torch.Tensor:
    """Move post-RoPE keys from `old_positions` to `new_positions` by R(p_new - p_old).

    keys: [..., S, H_kv, D] (leading dims, e.g. layers, broadcast: all layers of all entries of a
    request rotate in one call); positions: [S] or [3, S].
    Tokens whose delta is zero in every row come back bit-identical. The positions may live on
    any device (plan positions are host tensors): the delta and its angles [S, D/2] are formed
    on the host (a few small ops, as HF computes its inv_freq) and moved to the keys' device in
    one copy, so this costs no device->host sync and one host-to-device copy.
    """
    delta = new_positions.cpu().to(torch.int64) - old_positions.cpu().to(torch.int64)
    if not bool(delta.any()):
        return keys
    return apply_rotation(keys, rope_angles(delta, rope).to(keys.device))
