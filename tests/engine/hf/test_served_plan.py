"""`served_plan`, what a process that does not run the link pass (the vLLM front end) knows of
the plan it serves, counts the same recomputed and stored tokens as the pass itself (the
reference runner's prefill), for every policy family, images and documents: the usage's
`cached_tokens` of both engines agree."""

from __future__ import annotations

import io

import pytest

from mpic.engine.hf.reference_runner import ReferenceRunner
from mpic.engine.request_flow import stored_linked_tokens
from mpic.linker.pipeline import served_plan
from mpic.linker.prompt import DocumentRef, ImageRef

POLICIES = ["auto", "scout-0.3", "scout-0.1", "mpic-32", "full-reuse", "vlcache-0.1"]


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def _check(runner: ReferenceRunner, parts: list, policy: str) -> None:
    planned = runner.plan(parts, policy)
    prefix = planned.prefix.length if planned.prefix is not None else 0
    served = served_plan(planned, runner.adapter.num_layers, prefix)
    pre = runner.prefill(parts, policy)
    assert stored_linked_tokens(served) == stored_linked_tokens(pre.plan)
    ran = served.recompute_depth > 0
    if planned.policy.two_step:  # its first pass runs the text (depth 0 in the plan)
        ran |= served.is_text
    assert int(ran.sum()) == pre.recomputed_tokens
    if planned.policy.scouts:  # the picks themselves differ: only their number is known
        assert stored_linked_tokens(served) < stored_linked_tokens(planned.plan)


@pytest.fixture(scope="module")
def image_runner(tiny_model_dir, sample_images):
    r = ReferenceRunner(str(tiny_model_dir))
    r.test_ids = [r.cache_image(_png(img)).entry_id for img in sample_images[:2]]
    return r


@pytest.mark.parametrize("policy", POLICIES)
def test_images(image_runner, policy) -> None:
    a, b = image_runner.test_ids
    parts = ["Compare", ImageRef(a), "with", ImageRef(b), "and say which is darker."]
    _check(image_runner, parts, policy)


@pytest.mark.parametrize("policy", POLICIES)
def test_documents(smollm2_runner, policy) -> None:
    a = smollm2_runner.cache_document("The harbour opens at six. Boats leave at seven sharp.")
    b = smollm2_runner.cache_document("Tickets cost four euros. Children travel for free.")
    parts = [
        "Read",
        DocumentRef(a.entry_id),
        "and",
        DocumentRef(b.entry_id),
        "When do boats leave?",
    ]
    _check(smollm2_runner, parts, policy)
