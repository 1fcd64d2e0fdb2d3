"""The request flow both engines share (`mpic.engine.request_flow`) and the engine protocol they
implement (`mpic.engine.protocol.Engine`): streamed text cut at stop strings equals the decoded
text cut by hand, the finish reason follows vLLM's rule, a compressed item replaces its entry in
the prompt, and both backends offer every protocol member with the protocol's parameters."""

from __future__ import annotations

import inspect
import random
from pathlib import Path

import pytest

from mpic.engine.protocol import Engine
from mpic.engine.request_flow import TextStream, finish_reason, pressed_parts
from mpic.prompt_parts import DocumentRef, ImageRef


def _cut(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def test_text_stream_equals_decoded_text_cut_at_stops(tiny_llava_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llava_dir))
    rng = random.Random(1)
    cut_some = False
    for _ in range(60):
        ids = [rng.randrange(tok.vocab_size) for _ in range(20)]
        full = tok.decode(ids, skip_special_tokens=True)
        start = rng.randrange(max(len(full) - 2, 1))
        stops = [full[start : start + 2], "\x00never"] if len(full) > 3 else []
        want, stopped = _cut(full, stops)
        stream, pieces, i = TextStream(tok, stops), [], 0
        while i < len(ids) and not stream.stopped:
            step = rng.randint(1, 3)
            pieces.append(stream.push(ids[i : i + step]).text)
            i += step
        if (rest := stream.flush()) is not None:
            pieces.append(rest.text)
        assert "".join(pieces) == want
        assert stream.stopped == stopped
        cut_some |= stopped
    assert cut_some, "some random stop strings match"


@pytest.mark.parametrize(
    ("stopped", "length", "want"),
    [(False, False, "stop"), (False, True, "length"), (True, True, "stop"), (True, False, "stop")],
)
def test_finish_reason(stopped: bool, length: bool, want: str) -> None:
    assert finish_reason(stopped, length) == want


def test_pressed_parts_swaps_items_and_keeps_media() -> None:
    class Entry:
        def __init__(self, entry_id: str) -> None:
            self.entry_id = entry_id

    table = {"a": Entry("a"), "d": Entry("d")}
    media = {"a": b"png"}
    parts = ["x", ImageRef("a"), DocumentRef("d"), "y"]
    out = pressed_parts(parts, table, lambda e: Entry(e.entry_id + "/p"), media)
    assert out == ["x", ImageRef("a/p"), DocumentRef("d/p"), "y"]
    assert set(table) == {"a", "d", "a/p", "d/p"} and media == {"a": b"png", "a/p": b"png"}


PROTOCOL = ("cache_image", "cache_document", "press_entry", "plan")


@pytest.mark.parametrize(
    "backend",
    ["mpic.engine.hf.reference_runner:ReferenceRunner", "mpic.engine.vllm.frontend:VllmFrontEnd"],
)
def test_both_backends_implement_the_protocol(backend: str) -> None:
    import importlib

    module, _, name = backend.partition(":")
    cls = getattr(importlib.import_module(module), name)
    for member in PROTOCOL:
        want = list(inspect.signature(getattr(Engine, member)).parameters)
        got = list(inspect.signature(getattr(cls, member)).parameters)
        assert got[: len(want)] == want, f"{name}.{member}{got} differs from the protocol {want}"
