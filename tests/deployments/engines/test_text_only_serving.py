"""The reference serve engine on a text-only model (the trained SmolLM2: its processor is the
tokenizer itself): a cached document, a chat about it under full and the default, and the
tokenizer routes' tokenizer. In-process, no Ray."""

from __future__ import annotations

import asyncio
from pathlib import Path

from mpic.deployments.config import engine_config
from mpic.deployments.engines.engine import build_engine
from mpic.deployments.messages import DoneEvent, LinkedPrompt, LinkedTurn, Segment
from mpic.storage.config import StorageConfig

DOCUMENT = (
    "The harbour office keeps its ledgers in the east wing. The secret code is 4821. "
    "Visitors sign in at the gate and leave before sunset."
)


def _answer(engine, entry, policy: str) -> tuple[str, DoneEvent]:  # noqa: ANN001
    prompt = LinkedPrompt(
        [
            LinkedTurn(
                "user",
                [
                    Segment("entry", entry_id=entry.entry_id, document=True),
                    Segment("text", text="In which wing are the ledgers kept?"),
                ],
            )
        ],
        policy,
        12,
    )

    async def run() -> list:
        return [ev async for ev in engine.generate(prompt, {entry.entry_id: entry})]

    events = asyncio.run(run())
    assert isinstance(events[-1], DoneEvent)
    return "".join(ev.text for ev in events[:-1]), events[-1]


def test_the_reference_engine_serves_a_text_only_model(smollm2_dir: Path, tmp_path: Path) -> None:
    store = StorageConfig(url=tmp_path.as_uri(), fsync=False)
    engine = build_engine(engine_config(kind="reference", model=str(smollm2_dir)), store, "worker")
    tokenizer = engine.text_tokenizer
    assert tokenizer.decode(tokenizer.encode("secret code")).strip() == "secret code"
    entry = engine.compute_document_entry(DOCUMENT)
    full, done = _answer(engine, entry, "full")
    assert "east wing" in full  # the answer comes from the cached document
    assert done.prompt_tokens > len(tokenizer.encode(DOCUMENT))
    auto, done = _answer(engine, entry, "auto")
    assert done.cached_tokens > 0  # the document was linked, not recomputed whole
    # the 135M model's answer under the default quotes the document too (not always the same
    # sentence as full's: docs/fidelity.md measures how often the answers agree)
    assert any(fact in auto for fact in ("east wing", "4821", "sunset"))
