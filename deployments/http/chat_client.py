"""Client-side pieces of the streaming chat API shared by the HTTP demo and the load benchmark
(CLI process): the request body with MPIC's extension and the SSE line parser."""

from __future__ import annotations

import json
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
