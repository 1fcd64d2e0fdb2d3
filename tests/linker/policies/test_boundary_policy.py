"""`boundary-k` (mpic-k plus the line breaks of documents) on the toy decoder's entries: exactly
its tokens, images unchanged from mpic-k, registry parsing; documents as plan items."""

import dataclasses

import pytest
import torch

from mpic.errors import InvalidRequestError
from mpic.linker.plan import build_plan, resolve_entries, unique_entries
from mpic.linker.policies import get_policy
from mpic.linker.prompt import DOCUMENT_PLACEHOLDER
from tests.linker.toy_model import CONTEXT, IMAGE_ID, ToyAdapter, toy_entries, toy_spec

L = 3


def _entries():
    adapter = ToyAdapter(num_layers=L)
    entries = toy_entries(adapter)
    img_b = entries["img-b"]  # 4 tokens: turned into a document with its own ids
    doc = dataclasses.replace(
        img_b,
        entry_id="doc",
        media_type="text",
        extra={**img_b.extra, "token_ids": [20, 21, 22, 23], "line_breaks": [2]},
    )
    return adapter, {**entries, "doc": doc}


def _plan(prompt, refs):
    adapter, entries = _entries()
    items = resolve_entries(refs, entries)
    plan = build_plan(toy_spec(adapter), prompt, items)
    return plan, unique_entries(plan, items)


# slots: text 0-4 | img-a 5-10 | text 11 | doc 12-15 | text 16 | doc 17-20 | text 21
PROMPT = CONTEXT + [10, 11, IMAGE_ID, 12, DOCUMENT_PLACEHOLDER, 13, DOCUMENT_PLACEHOLDER, 14]


def test_documents_expand_to_their_own_ids_at_text_positions() -> None:
    plan, _ = _plan(PROMPT, ["img-a", "doc", "doc"])
    assert plan.token_ids[12:16].tolist() == [20, 21, 22, 23] == plan.token_ids[17:21].tolist()
    assert plan.token_ids[5:11].tolist() == [IMAGE_ID] * 6
    assert plan.source_offset[12:16].tolist() == [0, 1, 2, 3]
    with pytest.raises(InvalidRequestError, match="referenced as an image"):
        _plan(CONTEXT + [IMAGE_ID], ["doc"])
    with pytest.raises(InvalidRequestError, match="referenced as a document"):
        _plan(CONTEXT + [DOCUMENT_PLACEHOLDER], ["img-a"])
    with pytest.raises(InvalidRequestError, match="2 item placeholders but 1"):
        _plan(CONTEXT + [DOCUMENT_PLACEHOLDER, IMAGE_ID], ["doc"])


@pytest.mark.parametrize("k", [0, 1, 2])
def test_boundary_k_selects_head_and_line_breaks(k: int) -> None:
    plan, entries = _plan(PROMPT, ["img-a", "doc", "doc"])
    policy = get_policy(f"boundary-{k}")
    assert policy.name == f"boundary-{k}" and not policy.two_step
    got = policy.apply(plan, entries, L).recompute_depth.tolist()
    text, off, src = plan.is_text.tolist(), plan.source_offset.tolist(), plan.source_entry.tolist()
    doc = plan.entry_ids.index("doc")
    want = [
        L if t or o < k or (s == doc and o == 2) else 0
        for t, o, s in zip(text, off, src, strict=True)
    ]
    want[-1] = L
    assert got == want
    # Images carry no line breaks: boundary-k is mpic-k on them.
    img = [i for i, s in enumerate(src) if s == plan.entry_ids.index("img-a")]
    mpic = get_policy(f"mpic-{k}").apply(plan, entries, L).recompute_depth
    assert torch.equal(torch.tensor(got)[img], mpic[img])


def test_boundary_rejects_bad_k() -> None:
    for bad in ("boundary--1", "boundary-x"):
        with pytest.raises(ValueError, match="valid:"):
            get_policy(bad)
