"""What both parts of `mpic bench linking` send (CLI process; vLLM's engine core and worker in
child processes): seeded images, the in-process vLLM engine (`AsyncVllmEngine`) on a storage
config, a linked request of text and cached images (or the same prompt as a plain vLLM request
with its images), and a stream that records each token's arrival time.
"""

from __future__ import annotations

import io
import time
import uuid
from typing import Any

import numpy as np


def png(seed: int, side: int = 48) -> bytes:
    """A seeded random RGB PNG."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def vllm_engine(model: str, storage: Any, **options: Any) -> Any:
    from mpic.engine.vllm.async_engine import AsyncVllmEngine
    from mpic.engine.vllm.config import VllmEngineConfig

    cfg = VllmEngineConfig(model=model, storage=storage, **options)
    return AsyncVllmEngine(cfg)


def linked_request(
    engine: Any,
    entries: list[Any],
    text: str,
    policy: str = "mpic-32",
    media: dict[str, bytes] | None = None,
) -> Any:
    """The linked request of text, image 1, 'and', image 2, ... (`policy` depths;
    `VllmFrontEnd.prepare`), salted: no prefix-cache hit between requests. With `media` (entry
    id -> image bytes): the same prompt as a plain vLLM request with its images instead."""
    from mpic.linker.prompt import ImageRef

    parts: list[Any] = [f"{text} ({uuid.uuid4().hex[:6]})"]
    for e in entries:
        parts += [ImageRef(e.entry_id), "and"]
    table = {e.entry_id: e for e in entries}
    salt = f"bench-{uuid.uuid4().hex}"
    exact = media is not None
    return engine.prepare(parts, table, policy, None, 16, media=media, exact=exact, salt=salt)[1]


async def stream_tokens(engine: Any, req: Any, max_tokens: int, times: list[float]) -> None:
    """Decode `req`, appending the arrival time of every token to `times`."""
    seen = 0
    async for res in engine.stream(req, max_tokens, {"ignore_eos": True}):
        now = time.perf_counter()
        times.extend([now] * (len(res.token_ids) - seen))
        seen = len(res.token_ids)
