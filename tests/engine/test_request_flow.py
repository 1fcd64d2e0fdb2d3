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
from mpic.engine.request_flow import EngineBase, TextStream, finish_reason, pressed_parts
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


PROTOCOL = ("cache_image", "cache_document", "press_entry", "plan", "decode", "generate")
BACKENDS = [
    "mpic.engine.hf.engine:ReferenceEngine",
    "mpic.engine.vllm.async_engine:AsyncVllmEngine",
    "mpic.deployments.engines.fake_engine:FakeEngine",
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_implements_the_protocol(backend: str) -> None:
    import importlib

    module, _, name = backend.partition(":")
    cls = getattr(importlib.import_module(module), name)
    assert Engine in cls.__mro__
    for member in PROTOCOL:
        want = list(inspect.signature(getattr(Engine, member)).parameters)
        got = list(inspect.signature(getattr(cls, member)).parameters)
        assert got[: len(want)] == want, f"{name}.{member}{got} differs from the protocol {want}"
    assert cls.generate is EngineBase.generate, f"{name} writes its own generation flow"


class _Words:
    """A tokenizer whose ids are letters: id i decodes to chr(ord('a') + i); 0 is the end."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:  # noqa: ANN001
        return "".join(chr(ord("a") + i - 1) for i in ids if i)


class _Scripted(EngineBase):
    """A backend that decodes a fixed id script, one or two ids per step, and records whether
    the flow closed it."""

    def __init__(self, script: list[int], end: int = 0) -> None:
        from types import SimpleNamespace

        self.script, self.closed, self.steps = script, False, 0
        self.spec = SimpleNamespace(end_token_ids=(end,))

    @property
    def processor(self):  # noqa: ANN201
        return _Words()

    async def decode(self, request):  # noqa: ANN001, ANN201
        from mpic.engine.protocol import Decoded, Prefill

        try:
            for i in range(0, len(self.script), 2):
                self.steps += 1
                prefill = Prefill(7, 3, 0.5, fallbacks=1) if i == 0 else None
                yield Decoded(self.script[i : i + 2], None, prefill)
        finally:
            self.closed = True


def _generate(engine: Engine, **kw):  # noqa: ANN003, ANN202
    import asyncio

    from mpic.engine.protocol import GenerateRequest, Sampling

    stop = kw.pop("stop", [])
    ignore_eos = kw.pop("ignore_eos", False)
    request = GenerateRequest(
        parts=[], entries={}, sampling=Sampling(stop=stop, ignore_eos=ignore_eos), **kw
    )

    async def run() -> list:
        return [ev async for ev in engine.generate(request)]

    return asyncio.run(run())


@pytest.mark.parametrize(
    ("script", "max_tokens", "ignore_eos", "text", "finish"),
    [
        ([1, 2, 3], 3, False, "abc", "length"),  # max_tokens ran out
        ([1, 2, 0], 3, False, "ab", "stop"),  # an end id at the last step: "stop"
        ([1, 0], 5, False, "a", "stop"),
        ([1, 0, 2], 3, True, "ab", "length"),  # decoded past the end id
    ],
)
def test_generate_finish_reason_and_usage(
    script: list[int], max_tokens: int, ignore_eos: bool, text: str, finish: str
) -> None:
    from mpic.engine.protocol import DoneEvent, TokenEvent

    engine = _Scripted(script)
    events = _generate(engine, max_tokens=max_tokens, ignore_eos=ignore_eos, policy="auto")
    *pieces, done = events
    assert all(isinstance(e, TokenEvent) for e in pieces) and isinstance(done, DoneEvent)
    assert "".join(e.text for e in pieces) == text
    assert (done.finish_reason, done.completion_tokens) == (finish, len(script))
    assert (done.prompt_tokens, done.cached_tokens, done.fallbacks) == (7, 3, 1)
    assert (done.ttft_s, done.policy) == (0.5, "auto")
    assert engine.closed


def test_generate_stops_the_backend_at_a_stop_string() -> None:
    engine = _Scripted([1, 2, 3, 4, 5, 6, 7, 8])  # "abcdefgh"
    *pieces, done = _generate(engine, max_tokens=8, stop=["cd"])
    assert "".join(e.text for e in pieces) == "ab"
    assert done.finish_reason == "stop" and done.completion_tokens == 4
    assert engine.closed and engine.steps == 2, "the backend decoded past the stop string"


def test_generate_without_a_prefill_ends_without_done() -> None:
    assert _generate(_Scripted([]), max_tokens=4) == []
