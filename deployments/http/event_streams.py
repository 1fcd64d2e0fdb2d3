"""Async streams of the streamed HTTP answers (Ingress replica): several choices' worker event
streams merged into one as their events come (`merged`: `n` > 1, several completion prompts),
and the first SSE line put back in front of the rest (`prepend`: a route reads it before it
answers 200, so an error before any output is an HTTP error, not an SSE event)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

_END = object()
"""A pump's last item: its stream is over."""


async def merged(streams: Sequence[AsyncIterable[T]]) -> AsyncIterator[tuple[int, T]]:
    """(i, item) for the items of every stream, as each arrives (each stream's in its order);
    the first error any stream raises ends the merge and is raised. Closed early (a client
    gone, an error), it stops the streams still running at once (`_stop`: the worker then
    aborts their generations) rather than when the garbage collector finds them."""
    its = [aiter(s) for s in streams]
    if len(its) == 1:  # read directly
        ended = False
        try:
            async for item in its[0]:
                yield 0, item
            ended = True
        finally:
            if not ended:
                await _stop(its)
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item, None))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((i, None, exc))
            return
        await queue.put((i, _END, None))

    pumps = [asyncio.create_task(pump(i, it)) for i, it in enumerate(its)]
    running = len(pumps)
    try:
        while running:
            i, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is _END:
                running -= 1
                continue
            yield i, item
    finally:
        if running:  # closed early, or a stream failed: stop the others
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            await _stop(its)


async def _stop(its: Sequence[AsyncIterator[Any]]) -> None:
    """Stop streams that may still run: an async generator is closed (`aclose`), a Serve
    `DeploymentResponseGenerator` cancelled (`cancel`)."""
    for it in its:
        if hasattr(it, "aclose"):
            await it.aclose()
        elif hasattr(it, "cancel"):
            it.cancel()


async def prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    """`first`, then the items of `rest`."""
    yield first
    async for item in rest:
        yield item
