"""HF layer adapters: driving every layer through the adapter reproduces the HF forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mpic.engine.hf.adapters import make_adapter
from mpic.engine.hf.vision import encode_images, image_layout
from mpic.types import MROPE_FAMILIES


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention with GQA: q [S, H, D], k/v [S, H_kv, D] -> [S, H, D]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return out.transpose(0, 1)


def _prompt(processor, spec, images):
    """Processor inputs of a user turn with text before, between and after two images."""
    content = [
        {"type": "text", "text": "Compare"},
        {"type": "image"},
        {"type": "text", "text": "with"},
        {"type": "image"},
        {"type": "text", "text": "briefly."},
    ]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )
    return processor(text=text, images=images, return_tensors="pt")


def _hf_positions(model, spec, inputs) -> torch.Tensor:
    """The positions the HF forward uses: [S] (1-D) or [3, S] from Qwen2-VL's get_rope_index."""
    ids = inputs["input_ids"]
    if spec.family not in MROPE_FAMILIES:
        return torch.arange(ids.shape[1], device=ids.device)
    positions, _ = model.model.get_rope_index(
        ids, inputs["mm_token_type_ids"], inputs["image_grid_thw"]
    )
    return positions[:, 0]


def _check_adapter_oracle(model, processor, spec, images) -> None:
    """All layers through the adapter + plain causal SDPA == the HF forward's logits."""
    inputs = _prompt(processor, spec, images).to(model.device)
    with torch.no_grad():
        expected = model(**inputs).logits[0].float()
    adapter = make_adapter(model)
    ids = inputs["input_ids"][0]
    image_rows = ids == spec.image_token_id
    assert int(image_rows.sum()) == sum(image_layout(processor, i).num_tokens for i in images)
    hidden = adapter.embed_tokens(ids).clone()
    hidden[image_rows] = torch.cat(encode_images(model, processor, images))
    positions = _hf_positions(model, spec, inputs)
    if spec.family in MROPE_FAMILIES:  # M-RoPE: image tokens are NOT at consecutive text positions
        assert not torch.equal(positions[0], positions[1])
    for layer in range(adapter.num_layers):
        q, k, v = adapter.attention_inputs(layer, hidden, positions)
        assert q.shape == (ids.numel(), adapter.num_heads, adapter.head_dim)
        assert k.shape == v.shape == (ids.numel(), adapter.num_kv_heads, adapter.head_dim)
        hidden = adapter.attention_output_and_mlp(layer, hidden, _causal_sdpa(q, k, v))
    logits = adapter.logits(hidden)
    assert logits.dtype == torch.float32
    assert logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert expected.std() > 0.1  # the comparison is not between near-constant logits


def test_adapter_layers_equal_hf_forward_with_images(tiny_hf, sample_images):
    _check_adapter_oracle(*tiny_hf, sample_images[:2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_adapter_oracle_on_cuda(tiny_model_dir, sample_images):
    from mpic.engine.hf.loader import load_hf_model

    model, processor, spec = load_hf_model(tiny_model_dir, device="cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    _check_adapter_oracle(model, processor, spec, sample_images[:2])


def test_adapter_keys_depend_on_positions(tiny_hf):
    """Post-RoPE keys move with the position; values do not (RoPE touches q and k only)."""
    model, _, spec = tiny_hf
    adapter = make_adapter(model)
    hidden = adapter.embed_tokens(torch.tensor([5, 9, 11]))
    base = torch.arange(3) if spec.rope.mrope_section is None else torch.arange(3).expand(3, 3)
    _, k0, v0 = adapter.attention_inputs(0, hidden, base)
    _, k1, v1 = adapter.attention_inputs(0, hidden, base + 7)
    torch.testing.assert_close(v0, v1)
    assert (k0 - k1).abs().max() > 1e-3
    assert adapter.rope == spec.rope
    assert (adapter.num_layers, adapter.num_kv_heads) == (spec.num_layers, spec.num_kv_heads)


def test_adapter_rejects_wrong_positions_and_models(tiny_hf):
    model, _, spec = tiny_hf
    adapter = make_adapter(model)
    hidden = adapter.embed_tokens(torch.tensor([5, 9, 11]))
    wrong = torch.arange(3).expand(3, 3) if spec.rope.mrope_section is None else torch.arange(3)
    with pytest.raises(ValueError, match="positions"):
        adapter.attention_inputs(0, hidden, wrong)
    with pytest.raises(ValueError, match="model_type"):
        make_adapter(torch.nn.Linear(2, 2))
