"""Text documents in the serving layer without a cluster: which uploads are documents, their
decoding, and the prompt parts the worker builds from resolved document segments."""

from __future__ import annotations

import pytest

from mpic.deployments.engines.prompting import prompt_parts
from mpic.deployments.messages import LinkedPrompt, LinkedTurn, Segment
from mpic.deployments.serve.files import document_media_type
from mpic.documents import decode_document
from mpic.errors import UnreadableMediaError
from mpic.prompt_parts import DocumentRef, ImageRef


@pytest.mark.parametrize(
    ("name", "ctype", "purpose", "want"),
    [
        ("a.txt", "application/octet-stream", "user_data", "text/plain"),
        ("A.MD", None, "user_data", "text/markdown"),
        ("blob", "text/plain; charset=utf-8", "user_data", "text/plain"),
        ("a.txt", "text/plain", "vision", None),  # purpose vision: always an image
        ("a.png", "image/png", "user_data", None),
    ],
)
def test_document_media_type(name, ctype, purpose, want) -> None:
    assert document_media_type(name, ctype, purpose) == want


def test_decode_document() -> None:
    assert decode_document("\ufeffhé".encode()) == "hé"
    with pytest.raises(UnreadableMediaError, match="not UTF-8"):
        decode_document(b"\xff\xfe\x00")


def test_document_segments_become_document_refs() -> None:
    seg = [
        Segment("text", text="read"),
        Segment("entry", entry_id="d1", document=True),
        Segment("entry", entry_id="i1"),
    ]
    prompt = LinkedPrompt(turns=[LinkedTurn("user", seg)], policy="mpic-4", max_tokens=4)
    _, parts = prompt_parts(prompt, None, lambda image: "inline")
    assert parts == ["read", DocumentRef("d1"), ImageRef("i1")]
