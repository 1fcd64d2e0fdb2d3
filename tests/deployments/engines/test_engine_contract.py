"""What the serve engine interface (`mpic.deployments.engines.engine.ServeEngine`) promises, checked
against every serve engine: the fake engine, the HF reference engine and vLLM + the MPIC connector
(slow: vLLM start-up), in-process (no Ray). Addressing, encoding, entries, the event
stream's shape, max_tokens, stop strings, logprobs, seeded sampling, concurrent streams, an
abandoned stream and the context limit: the same assertions for each engine."""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deployments.conftest import png

ENGINES = ["fake", "reference", pytest.param("vllm", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=ENGINES)
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    from mpic.deployments.config import engine_config
    from mpic.deployments.engines.engine import ServeEngine, build_engine
    from mpic.storage.config import StorageConfig

    kind = request.param
    model = "contract-fake" if kind == "fake" else str(request.getfixturevalue("tiny_llava_dir"))
    store = StorageConfig(url=tmp_path_factory.mktemp("store").as_uri(), fsync=False)
    eng = build_engine(engine_config(kind=kind, model=model), store, "worker")
    assert isinstance(eng, ServeEngine)
    try:
        yield eng
    finally:
        close = getattr(eng, "close", None) or getattr(eng, "shutdown", None)
        if callable(close):
            close()


@pytest.fixture(scope="module")
def cached(engine):  # noqa: ANN001, ANN201
    """(media, entry) of one image cached by the engine."""
    media = png(5)
    entry_id = engine.entry_id(media)
    entry = engine.compute_entry(entry_id, engine.encode_image(media))
    return media, entry


def _prompt(entry_id: str | None, text: str, max_tokens: int = 6, policy: str = "mpic-2", **s):  # noqa: ANN003, ANN202
    from mpic.deployments.messages import LinkedPrompt, LinkedTurn, Sampling, Segment

    segments = []
    if entry_id is not None:
        segments.append(Segment("entry", entry_id=entry_id))
    segments.append(Segment("text", text=text))
    return LinkedPrompt([LinkedTurn("user", segments)], policy, max_tokens, sampling=Sampling(**s))


async def _collect(engine, prompt, entries) -> tuple[list, object]:  # noqa: ANN001
    from mpic.deployments.messages import DoneEvent, TokenEvent

    events = [ev async for ev in engine.generate(prompt, entries)]
    assert events and isinstance(events[-1], DoneEvent), events[-1:]
    assert all(isinstance(ev, TokenEvent) for ev in events[:-1])
    return events[:-1], events[-1]


def _run(engine, prompt, entries) -> tuple[str, object, list]:  # noqa: ANN001
    tokens, done = asyncio.run(_collect(engine, prompt, entries))
    return "".join(t.text for t in tokens), done, tokens


def test_fingerprint_and_addressing(engine) -> None:  # noqa: ANN001
    fp = engine.fingerprint
    assert isinstance(fp, str) and fp and engine.fingerprint == fp
    a, b = engine.entry_id(png(1)), engine.entry_id(png(2))
    assert re.fullmatch(r"[0-9a-f]{64}", a) and a != b and engine.entry_id(png(1)) == a


def test_encode_image(engine) -> None:  # noqa: ANN001
    from mpic.errors import UnreadableMediaError

    media = png(3)
    image = engine.encode_image(media)
    assert image.media == media and image.media_type == "image/png"
    assert image.content_hash == hashlib.sha256(media).hexdigest()
    with pytest.raises(UnreadableMediaError):
        engine.encode_image(b"not an image at all")


def test_compute_entry(engine, cached) -> None:  # noqa: ANN001
    media, entry = cached
    assert entry.entry_id == engine.entry_id(media)
    assert entry.model_fingerprint == engine.fingerprint
    layers, tokens = entry.keys.shape[:2]
    assert entry.values.shape == entry.keys.shape and tokens == entry.num_tokens > 0
    assert entry.positions.shape[-1] == tokens and entry.input_embeds.shape[0] == tokens


def test_document_entry_or_415(engine) -> None:  # noqa: ANN001
    from mpic.errors import UnreadableMediaError

    try:
        entry = engine.compute_document_entry("A short passage about red cats.\n")
    except UnreadableMediaError as exc:
        assert exc.status == 415
        return
    assert entry.media_type == "text" and entry.num_tokens > 0
    assert re.fullmatch(r"[0-9a-f]{64}", entry.entry_id)


def test_stream_shape_and_determinism(engine, cached) -> None:  # noqa: ANN001
    _, entry = cached
    entries = {entry.entry_id: entry}
    text, done, tokens = _run(engine, _prompt(entry.entry_id, "red cat"), entries)
    assert done.finish_reason in ("stop", "length")
    assert 0 < done.completion_tokens <= 6 or (done.completion_tokens == 0 and not text)
    if done.finish_reason == "length":
        assert done.completion_tokens == 6
    assert 0 < done.cached_tokens <= entry.num_tokens < done.prompt_tokens
    assert done.ttft_s >= 0
    assert _run(engine, _prompt(entry.entry_id, "red cat"), entries)[0] == text  # greedy
    one, done1, _ = _run(engine, _prompt(entry.entry_id, "red cat", max_tokens=1), entries)
    assert done1.completion_tokens <= 1 and text.startswith(one)
    assert isinstance(engine.engine_stats(), dict)
    assert all(isinstance(v, int) for v in engine.engine_stats().values())


def test_stop_string(engine, cached) -> None:  # noqa: ANN001
    _, entry = cached
    entries = {entry.entry_id: entry}
    text, _, _ = _run(engine, _prompt(entry.entry_id, "red cat", max_tokens=8), entries)
    if len(text) < 3:
        pytest.skip(f"greedy answer too short to cut: {text!r}")
    stop = text[1:3]
    cut, done, _ = _run(engine, _prompt(entry.entry_id, "red cat", 8, stop=[stop]), entries)
    assert cut == text[: text.index(stop)] and done.finish_reason == "stop"


def test_logprobs(engine, cached) -> None:  # noqa: ANN001
    _, entry = cached
    prompt = _prompt(entry.entry_id, "red cat", max_tokens=3, logprobs=2)
    _, done, tokens = _run(engine, prompt, {entry.entry_id: entry})
    got = [lp for t in tokens for lp in (t.logprobs or [])]
    # one per generated token; an end token that stops the answer may carry none
    end = int(done.finish_reason == "stop")
    assert done.completion_tokens - end <= len(got) <= done.completion_tokens
    for lp in got:
        assert lp.logprob <= 0 and len(lp.top) == 2
        assert lp.top[0][1] >= lp.top[1][1] and lp.top[0][1] >= lp.logprob - 1e-4


def test_seeded_sampling(engine, cached) -> None:  # noqa: ANN001
    _, entry = cached
    entries = {entry.entry_id: entry}
    prompt = _prompt(entry.entry_id, "red cat", max_tokens=5, temperature=1.0, seed=7)
    assert _run(engine, prompt, entries)[0] == _run(engine, prompt, entries)[0]


def test_concurrent_streams_equal_sequential(engine, cached) -> None:  # noqa: ANN001
    _, entry = cached
    entries = {entry.entry_id: entry}
    texts = ["red cat", "blue dog on the left"]
    alone = [_run(engine, _prompt(entry.entry_id, t), entries)[0] for t in texts]

    async def both() -> list[str]:
        runs = await asyncio.gather(
            *(_collect(engine, _prompt(entry.entry_id, t), entries) for t in texts)
        )
        return ["".join(ev.text for ev in tokens) for tokens, _ in runs]

    assert asyncio.run(both()) == alone


def test_abandoned_stream_leaves_engine_usable(engine, cached) -> None:  # noqa: ANN001
    _, entry = cached
    entries = {entry.entry_id: entry}

    async def abandon() -> None:
        gen = engine.generate(_prompt(entry.entry_id, "red cat", max_tokens=200), entries)
        await anext(gen)
        await gen.aclose()

    asyncio.run(abandon())
    text, done, _ = _run(engine, _prompt(entry.entry_id, "red cat"), entries)
    assert done.completion_tokens <= 6


def test_over_context_is_invalid_request(engine) -> None:  # noqa: ANN001
    from mpic.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError):
        _run(engine, _prompt(None, "cat " * 40_000, max_tokens=2), {})


def test_engines_named(engine) -> None:  # noqa: ANN001
    from mpic.deployments.engines.engine import ENGINES

    assert {"fake", "reference", "vllm"} <= set(ENGINES)
    assert type(engine).__module__ in {v.partition(":")[0] for v in ENGINES.values()}
    assert Path(__file__).name.startswith("test_engine_contract")
