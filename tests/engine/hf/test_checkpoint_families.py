"""The checkpoint families at their own processors' resolutions (issue 12), on the reference
engine, against transformers' own model and processor.

For LLaVA-1.5, LLaVA-NeXT (anyres tiles + image newline), Qwen2-VL and Qwen2.5-VL (native
resolution; Qwen2.5-VL's tower uses window attention, and the 200x168 image spans several
windows) with four images of different sizes and aspect ratios:
- every image gets exactly the processor's token count (they differ per image);
- recompute-all (`full`) equals the plain HF forward (logits at 1e-4, same greedy tokens);
- an image linked where it was cached, after the same context, is exact with no image token
  recomputed;
- mpic-k recomputes exactly k tokens of each image occurrence (the first k), whatever its size;
- a prompt mixing the four sizes runs under every policy; the exact ones give HF's tokens.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from mpic.engine.hf.reference_runner import ReferenceRunner
from mpic.engine.hf.vision import image_layout
from mpic.linker.prompt import CONTEXT_LEAD_IN, ImageRef

SIZES = [(48, 40), (150, 60), (64, 96), (200, 168)]
"""(width, height): landscape, wide, portrait, and one over several Qwen2.5-VL windows."""
POLICIES = ["full", "prefix", "full-reuse", "mpic-0", "mpic-3", "cacheblend-0.25", "vlcache-0.5"]


def _images() -> list[Image.Image]:
    rng = np.random.RandomState(12)
    out = []
    for w, h in SIZES:
        ys, xs = np.mgrid[0:h, 0:w]
        base = np.stack([xs * 255 // w, ys * 255 // h, (xs + ys) % 256], axis=-1)
        noise = rng.randint(0, 64, (h, w, 3))
        out.append(Image.fromarray((base + noise).clip(0, 255).astype(np.uint8)))
    return out


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def runner(tiny_model_dir) -> ReferenceRunner:
    r = ReferenceRunner(str(tiny_model_dir))
    r.test_images = _images()
    r.test_ids = [r.cache_image(_png(img)).entry_id for img in r.test_images]
    return r


def _mixed_parts(runner: ReferenceRunner) -> tuple[list, list[Image.Image]]:
    ids, images = runner.test_ids, runner.test_images
    order = [0, 1, 2, 3, 1]
    parts: list = ["Look at these."]
    for n, i in enumerate(order):
        parts += [ImageRef(ids[i]), f"Picture {n}."]
    return parts + ["Which is widest?"], [images[i] for i in order]


def _hf_inputs(runner: ReferenceRunner, parts: list, images: list[Image.Image]):
    content = [
        {"type": "image"} if isinstance(p, ImageRef) else {"type": "text", "text": p} for p in parts
    ]
    text = runner.processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )
    return runner.processor(text=text, images=images, return_tensors="pt")


def test_each_image_has_the_processors_token_count(runner):
    counts = []
    for entry_id, image in zip(runner.test_ids, runner.test_images, strict=True):
        entry, layout = runner.entries[entry_id], image_layout(runner.processor, image)
        assert entry.num_tokens == layout.num_tokens
        assert entry.extra.get("image_grid_thw") == (
            None if layout.grid_thw is None else list(layout.grid_thw)
        )
        counts.append(entry.num_tokens)
    if runner.spec.family != "llava":  # LLaVA-1.5 crops to one size; the others do not
        assert len(set(counts)) > 1, counts


def test_recompute_all_equals_the_plain_model(runner):
    parts, images = _mixed_parts(runner)
    inputs = _hf_inputs(runner, parts, images)
    gen = runner.generate(parts, "full", max_new_tokens=6, stop_at_eos=False)
    assert torch.equal(gen.prefilled.plan.token_ids, inputs["input_ids"][0])
    with torch.inference_mode():
        hf_logits = runner.model(**inputs).logits[0, -1].float()
        hf_tokens = runner.model.generate(**inputs, max_new_tokens=6, do_sample=False)[0]
    hf_tokens = hf_tokens[inputs["input_ids"].shape[1] :].tolist()  # HF stops at EOS
    torch.testing.assert_close(gen.prefilled.logits, hf_logits, rtol=1e-4, atol=1e-4)
    assert gen.tokens[: len(hf_tokens)] == hf_tokens
    assert gen.prefilled.recomputed_tokens == gen.prefilled.plan.num_tokens


def test_image_linked_where_it_was_cached_is_exact(runner):
    """After the canonical context (its lead-in included) the linked image is exact."""
    for entry_id in runner.test_ids:
        parts = [CONTEXT_LEAD_IN, ImageRef(entry_id), "What is this?"]
        exact = runner.prefill(parts, "full")
        linked = runner.prefill(parts, "mpic-0")
        t = runner.entries[entry_id].num_tokens
        assert int((~linked.plan.is_text).sum()) == t
        assert linked.recomputed_tokens == linked.plan.num_tokens - t - linked.cached_prefix
        torch.testing.assert_close(linked.logits, exact.logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k", [1, 3])
def test_mpic_k_recomputes_k_tokens_of_each_image(runner, k):
    parts, _ = _mixed_parts(runner)
    plan = runner.prefill(parts, f"mpic-{k}").plan
    image = ~plan.is_text
    starts = torch.nonzero(image & (plan.source_offset == 0)).flatten().tolist()
    assert len(starts) == 5
    for n, start in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else plan.num_tokens
        occurrence = image[start:end]
        depth = plan.recompute_depth[start:end][occurrence]
        assert int((depth > 0).sum()) == k
        assert bool((depth[:k] > 0).all())  # the first k tokens of the image


def test_mixed_sizes_under_every_policy(runner):
    parts, images = _mixed_parts(runner)
    inputs = _hf_inputs(runner, parts, images)
    with torch.inference_mode():
        hf_logits = runner.model(**inputs).logits[0, -1].float()
    expected_ids = inputs["input_ids"][0]
    for policy in POLICIES:
        out = runner.prefill(parts, policy)
        assert torch.equal(out.plan.token_ids, expected_ids), policy
        assert torch.isfinite(out.logits).all(), policy
        if policy in ("full", "prefix"):  # exact policies
            torch.testing.assert_close(out.logits, hf_logits, rtol=1e-4, atol=1e-4)


def test_entry_grid_survives_the_codec(runner):
    """The stored blob carries each image's own token count and grid (storage/entry_codec)."""
    from mpic.storage.entry_codec import decode, encode

    for entry_id in runner.test_ids:
        entry = runner.entries[entry_id]
        back = decode(encode(entry))
        assert back.num_tokens == entry.num_tokens
        assert back.extra.get("image_grid_thw") == entry.extra.get("image_grid_thw")
        assert torch.equal(back.positions, entry.positions)


def test_model_folder_loads_from_an_s3_prefix(tiny_model_dir, s3_server, tmp_path, monkeypatch):
    """An HF folder uploaded unchanged under an S3 prefix loads like the local folder."""
    from mpic.engine.hf.loader import load_hf_model, resolve_model_dir
    from mpic.model_spec import ModelSpec
    from mpic.storage.s3_store import S3ObjectStore

    cfg = s3_server.config(prefix="models/family")
    store = S3ObjectStore(cfg)
    for path in sorted(tiny_model_dir.rglob("*")):
        if path.is_file():
            store.put(path.relative_to(tiny_model_dir).as_posix(), path.read_bytes())
    url = (
        f"s3://{cfg.bucket}/models/family?endpoint={cfg.endpoint}&secure=false"
        "&access_key=testing&secret_key=testing&region=us-east-1"
    )
    monkeypatch.setenv("MPIC_HOME", str(tmp_path))
    _, _, spec = load_hf_model(url)
    assert spec.path.startswith(str(tmp_path.resolve()))
    assert spec.fingerprint == ModelSpec.from_pretrained(tiny_model_dir).fingerprint
    assert resolve_model_dir(url) == spec.path  # cached: the same folder, nothing fetched


def test_vlcache_ratio_applies_to_each_images_own_token_count(runner):
    parts, _ = _mixed_parts(runner)
    plan = runner.prefill(parts, "vlcache-0.5").plan
    for index, entry_id in enumerate(plan.entry_ids):
        t = runner.entries[entry_id].num_tokens
        rows = plan.source_entry == index
        occurrences = int((rows & (plan.source_offset == 0)).sum())
        assert int((plan.recompute_depth[rows] > 0).sum()) == occurrences * (t // 2)


def test_linked_request_ships_each_images_own_grid(runner):
    """vLLM linked requests (M-RoPE) carry one grid per image occurrence, each its own."""
    from mpic.engine.vllm.requests import image_grids, linked_request
    from mpic.types import MROPE_FAMILIES

    parts, _ = _mixed_parts(runner)
    plan = runner.prefill(parts, "mpic-3").plan
    request = linked_request(plan, "mpic-3", runner.spec)
    spec = runner.spec
    if spec.family not in MROPE_FAMILIES:
        assert request.multi_modal_data is None
        assert request.prompt_token_ids == plan.token_ids.tolist()
        return
    order = [0, 1, 2, 3, 1]
    expected = [runner.entries[runner.test_ids[i]].extra["image_grid_thw"] for i in order]
    assert image_grids(plan, spec.image_token_id, spec.spatial_merge_size) == expected
    grid = request.multi_modal_data["image"]["image_grid_thw"]
    assert grid.tolist() == expected
    assert request.prompt_token_ids.count(spec.image_token_id) == len(order)
