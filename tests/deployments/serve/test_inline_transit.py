"""Inline images in transit (fast, no Ray cluster): the Resolver returns no object ref (only the
image's bytes), the Ingress owns the Encoder's ref for the request, and a ref lost on the way to
the LLM worker (Ray's `ReferenceCountingAssertionError`, seen as 2 HTTP 500s in 12 requests of
vLLM's benchmark client) is encoded again by the worker: a 200 with the same answer, counted as
a fallback; without the bytes, a 503 with Retry-After, never a 500."""

from __future__ import annotations

import asyncio
import base64

import pytest
import ray.exceptions

from mpic.deployments.chat_request import ChatCompletionRequest
from mpic.deployments.messages import EncodedImage, LinkedPrompt, LinkedTurn, Segment
from mpic.deployments.serve.admission import EngineUnavailableError
from mpic.deployments.serve.inline import resolve_inline
from tests.deployments.conftest import png


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _body(data: bytes) -> dict:
    content = [
        {"type": "image_url", "image_url": {"url": _data_url(data)}},
        {"type": "text", "text": "what is this"},
    ]
    return {"model": "mpic", "messages": [{"role": "user", "content": content}]}


class _LostRef:
    """An awaitable that fails as a Ray ObjectRef whose count was lost does."""

    def __await__(self):
        raise ray.exceptions.ReferenceCountingAssertionError("ab" * 28, None, "")
        yield  # pragma: no cover - makes this a generator


def test_the_resolver_returns_the_bytes_and_no_object_ref(fake_app) -> None:
    """A ref the Resolver owned, nested in the prompt it returns, is what Ray lost (Serve
    returns a replica's result through a streaming generator): the Resolver returns bytes."""
    data = png(5)
    body = ChatCompletionRequest.model_validate(_body(data))
    prompt = asyncio.run(fake_app.resolver.resolve("alice", body))
    (seg,) = [s for t in prompt.turns for s in t.segments if s.kind == "inline"]
    assert seg.embeds is None and seg.media == data


def test_a_lost_encoding_is_encoded_again_by_the_worker(fake_app, monkeypatch) -> None:
    data = png(6)
    r = fake_app.client.post(
        "/v1/chat/completions", headers=fake_app.headers("alice-key"), json=_body(data)
    )
    assert r.status_code == 200, r.text
    assert r.json()["mpic"]["fallbacks"] == 0

    class LostEncoder:  # the Encoder's ref arrives at the worker already freed
        class encode:  # noqa: N801 - a handle's method
            @staticmethod
            def remote(_: bytes):
                class Response:
                    async def _to_object_ref(self):
                        return _LostRef()

                return Response()

    monkeypatch.setattr(fake_app.ingress, "encoder", LostEncoder())
    lost = fake_app.client.post(
        "/v1/chat/completions", headers=fake_app.headers("alice-key"), json=_body(data)
    )
    assert lost.status_code == 200, lost.text
    assert lost.json()["choices"] == r.json()["choices"]
    assert lost.json()["usage"] == r.json()["usage"]
    assert lost.json()["mpic"]["fallbacks"] == 1


def test_a_lost_encoding_without_bytes_is_a_retryable_503() -> None:
    prompt = LinkedPrompt(
        turns=[LinkedTurn("user", [Segment("inline", embeds=_LostRef())])],
        policy="mpic-4",
        max_tokens=4,
    )
    with pytest.raises(EngineUnavailableError) as err:
        asyncio.run(resolve_inline(prompt, lambda b: pytest.fail("nothing to encode")))
    assert err.value.status == 503 and err.value.retry_after == 1


def test_an_encoded_image_passes_and_encoder_errors_pass_through() -> None:
    """Only a lost value is re-encoded: the Encoder's own 415/413/400 reach the client."""
    from mpic.errors import UnreadableMediaError

    done = EncodedImage(b"x", "h", "image/png", None)

    async def unreadable():
        raise UnreadableMediaError("not an image")

    prompt = LinkedPrompt(
        turns=[LinkedTurn("user", [Segment("inline", embeds=done, media=b"x")])],
        policy="mpic-4",
        max_tokens=4,
    )
    assert asyncio.run(resolve_inline(prompt, lambda b: pytest.fail("encoded"))) == 0
    assert prompt.turns[0].segments[0].embeds is done
    prompt.turns[0].segments[0].embeds = unreadable()
    with pytest.raises(UnreadableMediaError):
        asyncio.run(resolve_inline(prompt, lambda b: pytest.fail("encoded")))
