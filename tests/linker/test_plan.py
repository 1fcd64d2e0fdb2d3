"""Link plans for both families: layout, positions (checked against transformers' Qwen2-VL
rope index), bad input."""

from functools import partial
from types import SimpleNamespace

import pytest
import torch
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

from mpic.errors import InvalidRequestError, NotFoundError, PromptTooLongError
from mpic.linker.plan import build_plan, resolve_entries
from tests.linker.toy_model import CONTEXT, IMAGE_ID, ToyAdapter, toy_entries, toy_spec

PROMPT = CONTEXT + [10, 11, IMAGE_ID, 12, IMAGE_ID, 13, IMAGE_ID, 14, 15]
REFS = ["img-a", "img-b", "img-a"]


def _plan(mrope: bool, **kw):
    adapter = ToyAdapter(mrope=mrope)
    entries = toy_entries(adapter)
    return build_plan(toy_spec(adapter, **kw), PROMPT, resolve_entries(REFS, entries)), entries


def test_llava_layout_sources_and_positions():
    plan, _ = _plan(mrope=False)
    n = len(PROMPT) - 3 + 6 + 4 + 6
    assert plan.num_tokens == n
    assert torch.equal(plan.positions, torch.arange(n))
    assert plan.entry_ids == ["img-a", "img-b"]
    expected_src = [-1] * 5 + [0] * 6 + [-1] + [1] * 4 + [-1] + [0] * 6 + [-1] * 2
    assert plan.source_entry.tolist() == expected_src
    assert plan.source_offset[5:11].tolist() == list(range(6))
    assert plan.source_offset[17:23].tolist() == list(range(6))
    assert (plan.token_ids[plan.source_entry >= 0] == IMAGE_ID).all()
    assert plan.token_ids[plan.is_text].tolist() == [t for t in PROMPT if t != IMAGE_ID]
    assert (plan.recompute_depth == 0).all()


def test_mrope_positions_match_transformers_rope_index():
    plan, _ = _plan(mrope=True)
    # transformers' own rule on the same layout (grids before the 2x2 spatial merge)
    fake = SimpleNamespace(
        config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2))
    )
    fake.get_vision_position_ids = partial(Qwen2VLModel.get_vision_position_ids, fake)
    mm = (plan.source_entry >= 0).to(torch.int32)[None]
    grids = torch.tensor([[1, 4, 6], [1, 4, 4], [1, 4, 6]])
    expected, _ = Qwen2VLModel.get_rope_index(fake, plan.token_ids[None], mm, image_grid_thw=grids)
    assert torch.equal(plan.positions, expected[:, 0])


def test_bad_input_raises_before_anything():
    adapter = ToyAdapter()
    entries = toy_entries(adapter)
    with pytest.raises(NotFoundError):
        resolve_entries(["img-a", "nope"], entries)
    with pytest.raises(PromptTooLongError):
        build_plan(toy_spec(adapter, max_model_len=20), PROMPT, resolve_entries(REFS, entries))
    with pytest.raises(InvalidRequestError):
        build_plan(toy_spec(adapter), PROMPT, resolve_entries(REFS[:2], entries))
