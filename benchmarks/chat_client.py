"""Client-side pieces of the streaming chat API shared by the HTTP demo and the load benchmark
(CLI process; the server's routes are in `mpic.deployments.http`): the request body with MPIC's
extension, the SSE line parser, and what a streamed answer adds up to (`StreamedAnswer`)."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any


def streaming_chat_body(content: list[dict[str, Any]], policy: str, max_tokens: int) -> dict:
    """A streaming `/v1/chat/completions` body for one user turn of OpenAI content parts, with
    usage in the last chunk and MPIC's `policy` extension."""
    return {
        "model": "mpic",
        "stream": True,
        "max_tokens": max_tokens,
        "stream_options": {"include_usage": True},
        "mpic": {"policy": policy},
        "messages": [{"role": "user", "content": content}],
    }


def sse_chunk(line: str) -> dict | None:
    """The JSON chunk of one SSE line, or None for keep-alives, blank lines and `[DONE]`."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    return json.loads(line[6:])


@dataclass
class StreamedAnswer:
    """A streamed chat completion read line by line (`feed`): its text, the seconds from `t0`
    (`time.perf_counter()` at the request) to the first content piece, and the last chunk's
    usage."""

    t0: float = field(default_factory=time.perf_counter)
    ttft_s: float = math.nan
    pieces: list[str] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)

    def feed(self, line: str) -> None:
        """One SSE line of the response."""
        chunk = sse_chunk(line)
        if chunk is None:
            return
        for choice in chunk["choices"]:
            piece = choice["delta"].get("content")
            if piece is not None:
                if not self.pieces:
                    self.ttft_s = time.perf_counter() - self.t0
                self.pieces.append(piece)
        self.usage = chunk.get("usage") or self.usage

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def prompt_tokens(self) -> int:
        return int(self.usage.get("prompt_tokens", 0))

    @property
    def cached_tokens(self) -> int:
        """`usage.prompt_tokens_details.cached_tokens` (0 when absent)."""
        return int((self.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))

    @property
    def completion_tokens(self) -> int:
        return int(self.usage.get("completion_tokens", 0))
