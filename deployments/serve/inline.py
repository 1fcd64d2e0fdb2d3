"""Inline images in transit (the Ingress and LLM-worker Serve replicas).

An inline `image_url` part is encoded for its one request: the Resolver keeps its bytes in the
`Segment` (`media`), the Ingress asks the Encoder and puts the Encoder's ObjectRef in the segment
(`encode_inline`), and the LLM worker awaits it (`resolve_inline`).

Who owns that ObjectRef matters. The Ingress owns it and holds the prompt until the answer is
out, and the ref reaches the worker nested in a task argument, a borrow Ray counts. A ref the
Resolver owned and returned inside its `LinkedPrompt` did not survive: Serve returns a replica's
result through a streaming generator (`handle_request_with_rejection`), and Ray can lose the
count of refs nested in a yielded object (ray-project/ray#58080), so the worker's await failed
with `ReferenceCountingAssertionError` and the chat with a 500 (2 of 12 requests of vLLM's
benchmark client in one run).

Should the value still be lost (its owner died, a transport that does not count borrows), the
worker encodes the image itself from `media` (a fallback, logged as a WARNING); without the
bytes the client gets a 503 with Retry-After, never a 500.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import ray

from mpic.deployments.client_errors import ClientError, raise_client_error
from mpic.deployments.messages import EncodedImage, LinkedPrompt, Segment
from mpic.deployments.serve.admission import EngineUnavailableError

logger = logging.getLogger(__name__)


def inline_segments(prompt: LinkedPrompt) -> list[Segment]:
    """The prompt's inline-image segments, in prompt order."""
    return [s for t in prompt.turns for s in t.segments if s.kind == "inline"]


async def encode_inline(prompt: LinkedPrompt, encoder: Any) -> None:
    """In the Ingress, after the Resolver: ask the Encoder (`encoder`, its deployment handle)
    for every inline image not yet encoded, all at once; each segment's `embeds` becomes the
    Encoder's ObjectRef (not materialised here), owned by this process."""
    todo = [s for s in inline_segments(prompt) if s.embeds is None and s.media]
    refs = await asyncio.gather(*(encoder.encode.remote(s.media)._to_object_ref() for s in todo))
    for seg, ref in zip(todo, refs, strict=True):
        seg.embeds = ref


async def resolve_inline(
    prompt: LinkedPrompt, encode: Callable[[bytes], EncodedImage], request_id: str = ""
) -> int:
    """In the LLM worker: replace every inline segment's ObjectRef (or other awaitable) by its
    `EncodedImage`. A value lost in transit (`ray.exceptions.ObjectLostError` and its kinds:
    reference counting, owner died, freed) is re-encoded here by `encode` from the segment's
    bytes (run on a thread); without bytes, `EngineUnavailableError` (503, Retry-After). The
    Encoder's own errors (415, 413, 400: its `ClientError` values) are raised. Returns the
    number re-encoded here."""
    recomputed = 0
    for seg in inline_segments(prompt):
        if isinstance(seg.embeds, EncodedImage):
            continue
        if seg.embeds is not None:
            try:
                got = seg.embeds if isinstance(seg.embeds, ClientError) else await seg.embeds
                seg.embeds = raise_client_error(got)  # the Encoder's 4xx: raised here
                continue
            except ray.exceptions.ObjectLostError as exc:
                if not seg.media:
                    raise EngineUnavailableError(
                        "an inline image's encoding was lost in transit; retry the request",
                        retry_after=1,
                    ) from exc
                logger.warning(
                    "request %s: an inline image's encoding was lost in transit (%s); "
                    "encoding it again here",
                    request_id or "-",
                    type(exc).__name__,
                    extra={"request_id": request_id},
                )
        elif not seg.media:
            raise EngineUnavailableError(
                "an inline image reached the worker without its encoding or its bytes; retry "
                "the request",
                retry_after=1,
            )
        seg.embeds = await asyncio.to_thread(encode, seg.media)
        recomputed += 1
    return recomputed
