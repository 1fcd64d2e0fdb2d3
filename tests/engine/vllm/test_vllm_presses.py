"""KV presses on the vLLM path: compressed image entries (issue 15 item 4).

The uniform-across-layers variant (`mpic.presses.entries`): a press picks C = round(b T) of an
image's T tokens from all layers' scores over the image's canonical prefill and the compressed
entry is linked instead of the full one. Oracles: the reference runner's same variant
(`ReferenceRunner.press_entry`, HF modules, dense KV) on the same weights and uploaded entries:
the same kept tokens, the same K/V (f32, 1e-4) and the same greedy tokens; the prompt vLLM
schedules (and so its paged KV) is shorter by exactly (T - C) tokens per image. Both 1-D RoPE
families: LLaVA-1.5 and LLaVA-NeXT (anyres); M-RoPE families are refused (400 fields).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from mpic.engine.hf.reference_runner import ReferenceRunner
from mpic.engine.vllm.presses import check_press
from mpic.errors import InvalidRequestError
from mpic.linker.prompt import ImageRef
from mpic.model_spec import ModelSpec
from mpic.presses import PRESS_NAMES
from mpic.presses.base import keep_count
from mpic.presses.entries import press_entry_id
from mpic.samples import synthetic_png
from mpic.types import CacheEntry

SYSTEM = "You are a careful assistant."
BUDGET = 0.3
POLICY = "mpic-4"
BLOCK = 32


@dataclass
class Setup:
    engine: object  # VllmEngine
    ref: ReferenceRunner
    entries: list[CacheEntry]


@pytest.fixture(scope="module", params=["llava", "llava-next"])
def setup(request, tiny_models_root, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN001, ANN201
    pytest.importorskip("vllm")
    from mpic.engine.vllm.engine import VllmEngine
    from tests.fixtures.models import _tiny_dir, press_vllm_config

    model_dir = _tiny_dir(tiny_models_root, request.param)
    store_dir = tmp_path_factory.mktemp(f"vllm-press-store-{request.param}")
    cfg = press_vllm_config(model_dir, store_dir)
    engine = VllmEngine(cfg)
    ref = ReferenceRunner(str(model_dir), system_prompt=SYSTEM)
    entries = [engine.cache_image(synthetic_png(i), SYSTEM) for i in range(3)]
    for entry in entries:
        ref.add_entry(entry)
    yield Setup(engine, ref, entries)
    engine.close()


def _parts(entries: list[CacheEntry]) -> list:
    parts: list = ["Compare"]
    for n, entry in enumerate(entries):
        parts += [ImageRef(entry.entry_id), f"item {n}"]
    return [*parts, "Which one is brighter?"]


def _generate(s: Setup, entries: list[CacheEntry], tokens: int = 10, policy: str = POLICY):  # noqa: ANN202
    """(reference generation, vLLM result) of the same prompt linking `entries`."""
    from mpic.engine.vllm.requests import linked_request

    for entry in entries:
        s.ref.add_entry(entry)
    expected = s.ref.generate(_parts(entries), policy, max_new_tokens=tokens)
    plan = expected.prefilled.plan
    (got,) = s.engine.generate([linked_request(plan, policy, s.engine.spec)], tokens)
    return expected, got


@pytest.mark.slow
@pytest.mark.parametrize("press", PRESS_NAMES)
def test_press_on_vllm_equals_reference_variant(setup: Setup, press: str) -> None:
    order = [setup.entries[i] for i in (2, 0, 1)]
    pressed = [setup.engine.press_entry(e, press, BUDGET) for e in order]
    for full, got in zip(order, pressed, strict=True):
        want = setup.ref.press_entry(full, press, BUDGET)
        assert got.entry_id == want.entry_id == press_entry_id(full.entry_id, press, BUDGET)
        assert got.extra["press"]["kept"] == want.extra["press"]["kept"]
        assert got.num_tokens == keep_count(BUDGET, full.num_tokens)
        torch.testing.assert_close(got.keys, want.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.values, want.values, atol=1e-4, rtol=1e-4)
        assert torch.equal(got.positions, want.positions)
    expected, got = _generate(setup, pressed)
    assert got.token_ids == expected.tokens


@pytest.mark.slow
def test_compressed_documents_equal_reference_variant(setup: Setup) -> None:
    from mpic.engine.vllm.requests import linked_request
    from mpic.prompt_parts import DocumentRef

    texts = [
        "The red squares sit left of the blue circles; the green triangles are above them all.",
        "Shopping list: two apples, bread, milk, a bag of rice and three onions for the soup.",
    ]
    docs = [setup.engine.cache_document(t, SYSTEM) for t in texts]
    parts: list = ["Read"]
    for doc in docs:
        setup.ref.add_entry(doc)
        got = setup.engine.press_entry(doc, "elastic", BUDGET)
        want = setup.ref.press_entry(doc, "elastic", BUDGET)
        assert got.extra["press"]["kept"] == want.extra["press"]["kept"]
        kept = got.extra["press"]["kept"]
        assert got.extra["token_ids"] == [doc.extra["token_ids"][i] for i in kept]
        assert got.num_tokens == keep_count(BUDGET, doc.num_tokens)
        setup.ref.add_entry(want)
        parts += [DocumentRef(got.entry_id), "and"]
    expected = setup.ref.generate([*parts, "what is left?"], POLICY, 8)
    plan = expected.prefilled.plan
    (out,) = setup.engine.generate([linked_request(plan, POLICY, setup.engine.spec)], 8)
    assert out.token_ids == expected.tokens


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "full-reuse", "cacheblend-15", "mpic-1"])
def test_compressed_entries_compose_with_policies(setup: Setup, policy: str) -> None:
    order = [setup.entries[i] for i in (1, 2)]
    pressed = [setup.engine.press_entry(e, "mm-shiftkv", BUDGET) for e in order]
    expected, got = _generate(setup, pressed, 8, policy)
    assert got.token_ids == expected.tokens


@pytest.mark.slow
def test_prompt_and_paged_kv_shrink(setup: Setup) -> None:
    order = [setup.entries[i] for i in (0, 1, 0)]  # a repeated image is compressed once
    pressed = [setup.engine.press_entry(e, "elastic", BUDGET) for e in order]
    full_ref, full = _generate(setup, order, 4)
    small_ref, small = _generate(setup, pressed, 4)
    n_full, n_small = full_ref.prefilled.plan.num_tokens, small_ref.prefilled.plan.num_tokens
    assert n_full - n_small == sum(e.num_tokens - keep_count(BUDGET, e.num_tokens) for e in order)
    # vLLM's prompt really is that long: the connector claimed all tokens but the last
    assert full.num_cached_tokens == n_full - 1
    assert small.num_cached_tokens == n_small - 1
    # paged KV blocks held while decoding 4 tokens
    assert math.ceil((n_small + 4) / BLOCK) < math.ceil((n_full + 4) / BLOCK)


@pytest.mark.slow
def test_budget_one_is_no_press(setup: Setup) -> None:
    order = [setup.entries[i] for i in (1, 2)]
    same = [setup.engine.press_entry(e, "meda", 1.0) for e in order]
    assert [e.entry_id for e in same] == [e.entry_id for e in order]
    expected, got = _generate(setup, same)
    (_, plain) = _generate(setup, order)
    assert got.token_ids == plain.token_ids == expected.tokens


@pytest.mark.slow
def test_compressed_entry_is_stored_and_reused(setup: Setup) -> None:
    entry = setup.entries[0]
    first = setup.engine.press_entry(entry, "window", BUDGET)
    key = press_entry_id(entry.entry_id, "window", BUDGET)
    assert setup.engine.store.locate(key) is not None
    assert first.extra["press"] == {
        "source": entry.entry_id,
        "press": "window",
        "budget": BUDGET,
        "kept": list(range(entry.num_tokens - first.num_tokens, entry.num_tokens)),
        "source_tokens": entry.num_tokens,
    }
    again = setup.engine.press_entry(entry, "window", BUDGET)  # read back, no new request
    assert torch.equal(again.keys, first.keys)


def test_vllm_path_refuses_what_it_cannot_do(tiny_llava_dir, tiny_qwen2vl_dir) -> None:  # noqa: ANN001
    llava = ModelSpec.from_pretrained(str(tiny_llava_dir))
    check_press(llava, "meda", 0.3)
    check_press(llava, None, None)
    with pytest.raises(InvalidRequestError) as err:
        check_press(llava, "h2o", 0.3)
    assert err.value.param == "mpic.press"
    with pytest.raises(InvalidRequestError) as err:
        check_press(llava, "meda", 1.5)
    assert err.value.param == "mpic.budget"
    qwen = ModelSpec.from_pretrained(str(tiny_qwen2vl_dir))
    with pytest.raises(InvalidRequestError, match="M-RoPE") as err:
        check_press(qwen, "meda", 0.3)
    assert err.value.param == "mpic.press"
