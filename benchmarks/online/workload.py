"""The online workload shared by `mpic bench online`'s open loop (`bench`) and closed loop
(`closed`): users' items and chats, the request of each
system for a chat (`VllmFrontEnd.prepare`), the engine session, a request's token timing, the
TTFT percentiles, and the models of `--models`.

Chats: U users each upload K items (images for a LLaVA model, text documents for a text model);
each chat is from a random user and links `items` of that user's items in a random order, with
text of random length before, between and after them (the items sit at varying positions),
then a question. Systems: a policy (linked requests, a fresh cache salt each), `prefix` (the
exact prompt, no salt: vLLM's automatic prefix caching) and `full` (the exact prompt, a fresh
salt).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import typer

from mpic.benchmarks.linking.requests import png

WORDS = (
    "river stone harbor signal lantern orchard meadow copper violet engine window ledger canyon "
    "pillar thunder marble garden summit beacon ferry compass quarry velvet timber saddle"
).split()


@dataclass
class ChatSpec:
    """One chat: a user and its parts (text, or the index of one of the user's items)."""

    user: int
    parts: list[str | int]


def chat_stream(users: int, per_user: int, items: int, seed: int) -> Iterator[ChatSpec]:
    """Endless seeded chats: items of the chat's user at varying positions among random text
    (the first `n` are `make_chats(n, ...)`'s)."""
    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    while True:
        user = rng.randrange(users)
        picked = rng.sample(range(per_user), items)
        parts: list[str | int] = []
        if rng.random() < 0.7:
            parts.append(text(1, 24))
        for i in picked:
            parts.append(user * per_user + i)
            if rng.random() < 0.6:
                parts.append(text(1, 12))
        parts.append("Question: " + text(4, 12) + "?")
        yield ChatSpec(user, parts)


def make_chats(n: int, users: int, per_user: int, items: int, seed: int) -> list[ChatSpec]:
    """`n` chats; items of the chat's user at varying positions among random text."""
    return list(itertools.islice(chat_stream(users, per_user, items, seed), n))


def document(seed: int, words: int = 160) -> str:
    """A seeded text document (sentences of common words)."""
    rng = random.Random(seed)
    out = []
    for _ in range(words // 10):
        out.append(" ".join(rng.choice(WORDS) for _ in range(10)).capitalize() + ".")
    return " ".join(out)


class Workload:
    """The engine, the users' items and the requests of each system for a chat."""

    def __init__(self, engine: Any, kind: str, users: int, per_user: int, seed: int) -> None:
        self.engine, self.kind = engine, kind
        self.media: dict[str, bytes] = {}
        self.entries = []
        for u in range(users):
            for i in range(per_user):
                if kind == "image":
                    data = png(1000 * seed + 10 * u + i, side=64)
                    entry = engine.cache_image(data)
                    self.media[entry.entry_id] = data
                else:
                    entry = engine.cache_document(document(1000 * seed + 10 * u + i))
                self.entries.append(entry)
        self.table = {e.entry_id: e for e in self.entries}

    def _parts(self, chat: ChatSpec) -> list[Any]:
        from mpic.prompt_parts import DocumentRef, ImageRef

        ref = ImageRef if self.kind == "image" else DocumentRef
        return [p if isinstance(p, str) else ref(self.entries[p].entry_id) for p in chat.parts]

    def request(self, chat: ChatSpec, system: str, max_tokens: int) -> Any:
        """The engine request of `chat` under `system` (a policy, `prefix` or `full`), built by
        `VllmFrontEnd.prepare`: linked under a policy (fresh salt: no linked KV reused across
        runs), exact for `prefix` (no salt: vLLM's prefix caching) and `full` (fresh salt)."""
        exact = system in ("prefix", "full")
        salt = None if system == "prefix" else f"online-{system}-{uuid.uuid4().hex}"
        _, req = self.engine.prepare(
            self._parts(chat), self.table, "full" if exact else system,
            max_new_tokens=max_tokens, media=self.media, exact=exact, salt=salt,
        )  # fmt: skip
        return req


async def reset_prefix_cache(engine: Any) -> None:
    """vLLM's prefix cache emptied (on the engine's own event loop, from any other loop)."""
    await asyncio.to_thread(engine._call, engine.llm.reset_prefix_cache())


async def token_times(engine: Any, req: Any, max_tokens: int) -> tuple[float, list[float]]:
    """(submission time, the time each output token arrived) of one request (`perf_counter`
    seconds; tokens that arrive together share their arrival time)."""
    t0 = time.perf_counter()
    times: list[float] = []
    async for res in engine.stream(req, max_tokens, {"ignore_eos": True}):
        now = time.perf_counter()
        times.extend([now] * (len(res.token_ids) - len(times)))
    return t0, times


async def ttft(engine: Any, req: Any, max_tokens: int) -> tuple[float, float]:
    """(seconds to the first token, seconds to the last) of one request."""
    t0, times = await token_times(engine, req, max_tokens)
    end = times[-1] if times else time.perf_counter()
    return (times[0] if times else end) - t0, end - t0


def percentiles_ms(seconds: Sequence[float]) -> list[float]:
    """p50, p95, p99 (numpy's linear interpolation) of durations in seconds, in ms."""
    return [1e3 * float(v) for v in np.percentile(seconds, [50, 95, 99])]


def unloaded(
    work: Workload, system: str, chats: list[ChatSpec], max_tokens: int, idle_s: float = 0.0
) -> list[float]:
    """TTFTs (ms) of `chats` sent one after the other, each after `idle_s` seconds of an idle
    engine (prefix cache reset first)."""

    async def run() -> list[float]:
        await reset_prefix_cache(work.engine)
        out = []
        for c in chats:
            req = work.request(c, system, max_tokens)
            await asyncio.sleep(idle_s)
            out.append((await ttft(work.engine, req, max_tokens))[0])
        return out

    return [1e3 * t for t in asyncio.run(run())]


@contextmanager
def engine_session(
    name: str, model: str, kind: str, users: int, per_user: int, seed: int, **options: Any
) -> Iterator[Workload]:
    """One vLLM engine on `model` (`AsyncVllmEngine`, a fresh store, 16 sequences at most) with
    the users' items uploaded; every system of a run is measured on it. Closed on exit.
    options: `VllmOptions` fields that differ from their defaults (`--dtype bfloat16`:
    `dtype="bfloat16"`)."""
    import tempfile

    from mpic.engine.vllm.async_engine import AsyncVllmEngine
    from mpic.engine.vllm.config import VllmEngineConfig
    from mpic.storage.config import StorageConfig

    storage = StorageConfig(url=Path(tempfile.mkdtemp()).as_uri(), fsync=False)
    engine = AsyncVllmEngine(
        VllmEngineConfig(model=model, storage=storage, max_num_seqs=16, **options)
    )
    try:
        work = Workload(engine, kind, users, per_user, seed)
        typer.echo(f"[{time.strftime('%H:%M:%S')}] {name}: {len(work.entries)} items uploaded")
        yield work
    finally:
        engine.close()


def _smollm2_dir() -> str:
    from mpic.config import MPICHome
    from mpic.engine.tiny.smollm2 import import_smollm2

    for path in (Path(".mpic/fixtures/smollm2"), MPICHome().models_dir / "smollm2"):
        if (path / "config.json").is_file():
            return str(path)
    return str(import_smollm2(MPICHome().models_dir / "smollm2"))


MODELS = ("llava", "smollm2")


def model_setup(name: str) -> tuple[str, str, int, int]:
    """(model folder, item kind, items per chat, items per user) of a `--models` name: `llava`
    (the embedded default), `smollm2`, or a model folder (its config's `vision_config` decides:
    3 images per chat like `llava`, else 4 documents like `smollm2`)."""
    from mpic.deployments.config import ServeAppConfig
    from mpic.deployments.local import prepare_local

    if name == "llava":
        return prepare_local(ServeAppConfig()).engine.model, "image", 3, 4
    if name == "smollm2":
        return _smollm2_dir(), "text", 4, 5
    config = Path(name) / "config.json"
    if config.is_file():
        if "vision_config" in json.loads(config.read_text()):
            return name, "image", 3, 4
        return name, "text", 4, 5
    raise typer.BadParameter(
        f"unknown model {name!r}; expected one of {list(MODELS)} or a model folder"
    )
