"""The `/v1/chat/completions` route (Ingress replica): OpenAI chat completions with cached-file
links, whole or streamed (SSE).

The ingress asks the Resolver to resolve the request into a linked prompt (then the Encoder for
its inline images: `mpic.deployments.serve.inline`), hands the prompt to the LLM worker and
answers with the worker's tokens: collected into one `ChatCompletion` (n choices, choice i
sampling with seed + i), or streamed as `ChatCompletionChunk` events (the n choices' events
merged as they come, each chunk naming its choice `index`; an error after the 200 is an SSE
error event, then `[DONE]`). Every finished generation is recorded on the replica's
metrics (`mpic.deployments.http.request_metrics`).

It is a method of `ChatRoutes`, a base class of the `Ingress` (Serve builds the routes of every
class in the ingress's MRO), on `router`, which the ingress's FastAPI app includes.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header, Request
from fastapi.responses import Response, StreamingResponse

from mpic.deployments.chat_request import ChatCompletionRequest
from mpic.deployments.http.chat_limits import check_chat_shape
from mpic.deployments.http.event_streams import merged, prepend
from mpic.deployments.http.http_errors import error_body, status_of
from mpic.deployments.http.request_metrics import replica_metrics
from mpic.deployments.http.schemas.answers import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    LogprobContent,
    PromptTokensDetails,
    TopLogprob,
    Usage,
)
from mpic.deployments.messages import DoneEvent, LinkedPrompt, TokenEvent, TokenLogprob
from mpic.deployments.serve.inline import encode_inline

logger = logging.getLogger(__name__)
router = APIRouter()


def chat_logprobs(items: list[TokenLogprob]) -> ChoiceLogprobs:
    """OpenAI logprobs; `bytes` are the token's own bytes when the engine gives them (a byte
    token of a multi-byte character: that byte), else the UTF-8 of its text."""

    def top(token: str, lp: float, raw: bytes | None) -> TopLogprob:
        return TopLogprob(
            token=token, logprob=lp, bytes=list(token.encode() if raw is None else raw)
        )

    return ChoiceLogprobs(
        content=[
            LogprobContent(
                token=t.token,
                logprob=t.logprob,
                bytes=list(t.token.encode() if t.raw is None else t.raw),
                top_logprobs=[
                    top(tok, lp, t.top_raw[k] if t.top_raw else None)
                    for k, (tok, lp) in enumerate(t.top)
                ],
            )
            for t in items
        ]
    )


def _usage(done: DoneEvent, completion_tokens: int | None = None) -> Usage:
    out = done.completion_tokens if completion_tokens is None else completion_tokens
    return Usage(
        prompt_tokens=done.prompt_tokens,
        completion_tokens=out,
        total_tokens=done.prompt_tokens + out,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=done.cached_tokens),
    )


def _mpic_info(prompt: LinkedPrompt, done: DoneEvent, ttft: float) -> dict:
    return {
        "policy": done.policy or prompt.policy,
        "request_id": prompt.request_id,
        "ttft_s": ttft,
        "engine_ttft_s": done.ttft_s,
        "tier_hits": done.tier_hits,
        "fallbacks": done.fallbacks,
        "retrieved": prompt.retrieved,
        "exact_decode": prompt.exact_decode,
    }


class _Answer:
    """One choice collected from the worker's events."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.done: DoneEvent | None = None
        self.t_first = self.t_last = 0.0

    async def collect(self, events) -> _Answer:
        async for ev in events:
            if isinstance(ev, TokenEvent):
                self.t_last = time.perf_counter()
                self.t_first = self.t_first or self.t_last
                self.text.append(ev.text)
                self.logprobs.extend(ev.logprobs or [])
            else:
                self.done = ev
        assert self.done is not None, "the worker always ends with a DoneEvent"
        return self


class ChatRoutes:
    """The chat route; mixed into `Ingress` (uses its `cfg`, `_auth`, `_check_model`,
    `readiness`, `resolver`, `encoder` and `worker`)."""

    @router.post("/v1/chat/completions")
    async def chat(
        self,
        request: Request,
        body: ChatCompletionRequest,
        authorization: Annotated[str | None, Header()] = None,
    ) -> Response:
        """OpenAI chat completion with cached-file links; SSE when `stream` is true."""
        who = self._auth(authorization)
        self._check_model(body.model)
        check_chat_shape(body, self.cfg.limits)
        await self.readiness.require()  # a fast 503 while the worker is still starting
        t0 = time.perf_counter()
        rid = request.state.request_id
        logger.info(
            "chat request %s user=%s end_user=%s",
            rid,
            who.user,
            body.user or "-",
            extra={"request_id": rid},
        )
        prompt: LinkedPrompt = await self.resolver.resolve.remote(who.user, body)
        await encode_inline(prompt, self.encoder)  # refs this replica owns while it answers
        prompt.request_id, prompt.sampling = rid, body.sampling()
        cid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        if body.stream:
            events = merged([self._generate(prompt, i) for i in range(body.n)])
            gen = self._sse(events, body, cid, created, prompt, t0)
            first = await anext(gen)  # surface errors before the 200 status is sent
            self.readiness.served()  # newer than any readiness poll that began before it
            return StreamingResponse(prepend(first, gen), media_type="text/event-stream")
        answers = await asyncio.gather(
            *(_Answer().collect(self._generate(prompt, i)) for i in range(body.n))
        )
        self.readiness.served()
        done = answers[0].done
        ttft = answers[0].t_first - t0
        for a in answers:
            replica_metrics().record(
                a.done.policy or prompt.policy, a.done, a.t_first - t0, a.t_last - a.t_first
            )
        out = ChatCompletion(
            id=cid,
            created=created,
            model=body.model,
            usage=_usage(done, sum(a.done.completion_tokens for a in answers)),
            choices=[
                Choice(
                    index=i,
                    message=AssistantMessage(content="".join(a.text)),
                    finish_reason=a.done.finish_reason,
                    logprobs=chat_logprobs(a.logprobs) if body.logprobs else None,
                )
                for i, a in enumerate(answers)
            ],
            mpic=_mpic_info(prompt, done, ttft),
        )
        return Response(out.model_dump_json(), media_type="application/json")

    def _generate(self, prompt: LinkedPrompt, index: int):
        """The worker's event stream of choice `index` (choice i samples with seed + i)."""
        if index and prompt.sampling.seed is not None:
            sampling = type(prompt.sampling)(**vars(prompt.sampling))
            sampling.seed = prompt.sampling.seed + index
            prompt = type(prompt)(**{**vars(prompt), "sampling": sampling})
        return self.worker.options(stream=True).generate.remote(prompt)

    async def _sse(self, events, body, cid, created, prompt, t0) -> AsyncIterator[str]:
        """The SSE lines of the merged choices' (index, event) stream (`merged`): each choice's
        pieces (its first with the assistant role), its finish chunk, then one usage chunk
        for all of them when asked (`stream_options.include_usage`)."""

        def chunk(index: int, delta: Delta | None, finish=None, usage=None, logprobs=None) -> str:
            choices = (
                [ChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=logprobs)]
                if delta
                else []
            )
            c = ChatCompletionChunk(
                id=cid, created=created, model=body.model, usage=usage, choices=choices
            )
            return f"data: {c.model_dump_json(exclude_none=True)}\n\n"

        t_first: dict[int, float] = {}  # choice -> its first piece's time
        done: list[DoneEvent] = []
        try:
            async for i, ev in events:
                if isinstance(ev, TokenEvent):
                    lps = chat_logprobs(ev.logprobs) if body.logprobs and ev.logprobs else None
                    if i not in t_first:
                        t_first[i] = time.perf_counter()
                        yield chunk(i, Delta(role="assistant", content=ev.text), logprobs=lps)
                    else:
                        yield chunk(i, Delta(content=ev.text), logprobs=lps)
                    continue
                first = t_first.setdefault(i, time.perf_counter())
                policy = ev.policy or prompt.policy
                replica_metrics().record(policy, ev, first - t0, time.perf_counter() - first)
                yield chunk(i, Delta(), finish=ev.finish_reason)
                done.append(ev)
            if body.stream_options and body.stream_options.include_usage:
                total = sum(ev.completion_tokens for ev in done)
                yield chunk(0, None, usage=_usage(done[0], total))
        except Exception as exc:  # noqa: BLE001 - after the 200: an SSE error event, then close
            if not t_first and not done:
                raise
            status = status_of(exc)
            if status >= 500:
                logger.exception("stream %s failed", prompt.request_id)
            else:
                logger.warning("stream %s ended by an error: %s", prompt.request_id, exc)
            replica_metrics().request("/v1/chat/completions", "stream_error")
            yield f"data: {error_body(exc).model_dump_json()}\n\n"
        finally:
            await events.aclose()  # closed early (the client gone): the worker stops now
        yield "data: [DONE]\n\n"
