"""The routes vLLM's OpenAI server has beside chat (Ingress replica): `/v1/completions`,
`/tokenize`, `/detokenize`, `/health` and `/version`, in vLLM's request and response shapes, so
scripts and tools written for `vllm serve` work against `mpic serve` unchanged.

They are methods of `VllmRoutes`, a base class of the `Ingress` (Serve builds the routes of every
class in the ingress's MRO), on `router`, which the ingress's FastAPI app includes: the same auth
(the ASGI guard and `_auth`), body limits, request ids and metrics as the chat route.

A completion is a chat with one user message rendered WITHOUT the chat template
(`LinkedPrompt.raw`, `mpic.linker.raw_prompt`): its text as given, with the `mpic` extension's
`files` (uploaded text documents) linked before it and retrieval as in chat. A completion has no
image placeholder, so images (files or retrieved) are refused with a 400 pointing to chat.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import Response, StreamingResponse

from mpic import installed_version
from mpic.deployments.chat_request import (
    ChatCompletionRequest,
    ChatMessage,
    FilePart,
    FileRef,
    MPICOptions,
    TextPart,
)
from mpic.deployments.http.event_streams import merged, prepend
from mpic.deployments.http.http_errors import error_body, status_of
from mpic.deployments.http.schemas.answers import PromptTokensDetails, Usage
from mpic.deployments.http.schemas.completions import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from mpic.deployments.messages import DoneEvent, LinkedPrompt, TokenEvent, TokenLogprob
from mpic.errors import InvalidRequestError

logger = logging.getLogger(__name__)
router = APIRouter()


def _usage(done: DoneEvent, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=done.prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=done.prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=done.cached_tokens),
    )


def completion_usage(jobs: list[tuple[LinkedPrompt, int]], dones: list[DoneEvent]) -> Usage:
    """The usage of a completion's choices (`dones[k]`: choice k's, `jobs[k]` its prompt and
    index among that prompt's n): each prompt's tokens once, as OpenAI counts them, every
    choice's completion tokens; cached tokens the first choice's."""
    out_tokens = sum(d.completion_tokens for d in dones)
    usage = _usage(dones[0], out_tokens)
    usage.prompt_tokens = sum(
        d.prompt_tokens for d, (_, i) in zip(dones, jobs, strict=True) if i == 0
    )
    usage.total_tokens = usage.prompt_tokens + out_tokens
    return usage


def completion_logprobs(items: list[TokenLogprob], offset: int = 0) -> CompletionLogprobs:
    """OpenAI legacy logprobs of generated tokens: token strings, their logprobs, the top
    alternatives as {token: logprob} and each token's character offset in the text (from
    `offset`)."""
    out = CompletionLogprobs()
    for t in items:
        out.tokens.append(t.token)
        out.token_logprobs.append(t.logprob)
        out.top_logprobs.append(dict(t.top) if t.top else {})
        out.text_offset.append(offset)
        offset += len(t.token)
    return out


def as_chat(body: CompletionRequest, prompt: str) -> ChatCompletionRequest:
    """The chat request the Resolver resolves for one completion prompt: one user message with
    the `mpic.files` linked before the text; the `mpic` options kept as they were set."""
    opts = body.mpic
    files = opts.files if opts is not None else []
    content: list[Any] = [FilePart(type="file", file=FileRef(file_id=f)) for f in files]
    content.append(TextPart(type="text", text=prompt))
    mpic = None
    if opts is not None:
        mpic = MPICOptions.model_validate(opts.model_dump(exclude={"files"}, exclude_unset=True))
    return ChatCompletionRequest(
        model=body.model,
        messages=[ChatMessage(role="user", content=content)],
        max_tokens=body.max_tokens,
        mpic=mpic,
    )


def check_text_only(prompt: LinkedPrompt) -> None:
    """400 when a completion prompt would link an image (it has no placeholder for one)."""
    for turn in prompt.turns:
        for seg in turn.segments:
            if seg.kind == "inline" or (seg.kind == "entry" and not seg.document):
                raise InvalidRequestError(
                    "a completion prompt links text documents only; send images through "
                    "/v1/chat/completions",
                    param="mpic.files",
                )


class VllmRoutes:
    """vLLM's non-chat routes; mixed into `Ingress` (uses its `cfg`, `_auth`, `_check_model`,
    `_model_info`, `_record`, `resolver` and `worker`)."""

    @router.get("/health")
    async def health(self) -> Response:
        """vLLM's health check (no auth): 200 with an empty body once the application can
        serve (every deployment ready), else 503 with Retry-After."""
        if getattr(self, "readiness", None) is not None:
            await self._require_ready()
        else:
            await self.worker.check_health.remote()
        return Response(status_code=200)

    async def _require_ready(self) -> None:
        """503 `not_ready` (Retry-After) while a deployment is still starting: a call to it
        would wait in Serve's queue until its replica has started."""
        readiness = getattr(self, "readiness", None)
        if readiness is not None:
            await readiness.require()

    @router.get("/version")
    async def version(self) -> VersionResponse:
        """vLLM's version route (no auth): this server's version."""
        return VersionResponse(version=installed_version())

    @router.post("/tokenize", response_model_exclude_none=True)
    async def tokenize(
        self, body: TokenizeRequest, authorization: Annotated[str | None, Header()] = None
    ) -> TokenizeResponse:
        """vLLM's `/tokenize`: the token ids of a text `prompt` (as `/v1/completions` tokenizes
        it) or of text chat `messages` (as `/v1/chat/completions` renders them), with
        `count` and the context length `max_model_len`."""
        self._auth(authorization)
        if body.model is not None:
            self._check_model(body.model)
        await self._require_ready()
        tokens, strs = await self.worker.tokenize.remote(
            body.prompt,
            body.messages,
            body.add_special_tokens,
            body.template_options(),
            body.return_token_strs,
        )
        info = await self._model_info()
        return TokenizeResponse(
            count=len(tokens), max_model_len=info, tokens=tokens, token_strs=strs
        )

    @router.post("/detokenize")
    async def detokenize(
        self, body: DetokenizeRequest, authorization: Annotated[str | None, Header()] = None
    ) -> DetokenizeResponse:
        """vLLM's `/detokenize`: the text of token ids (400 for an id outside the vocabulary)."""
        self._auth(authorization)
        if body.model is not None:
            self._check_model(body.model)
        await self._require_ready()
        return DetokenizeResponse(prompt=await self.worker.detokenize.remote(body.tokens))

    @router.post("/v1/completions")
    async def completions(
        self,
        request: Request,
        body: CompletionRequest,
        authorization: Annotated[str | None, Header()] = None,
    ) -> Response:
        """OpenAI legacy completion of a text prompt (several prompts: one choice set each);
        SSE when `stream` is true. `mpic` as in chat, plus `files` (text documents)."""
        who = self._auth(authorization)
        self._check_model(body.model)
        limit = self.cfg.limits.max_text_chars
        if sum(len(p) for p in body.prompts) > limit:
            raise InvalidRequestError(f"prompt over {limit} characters", param="prompt")
        await self._require_ready()
        t0 = time.perf_counter()
        rid = request.state.request_id
        prompts: list[LinkedPrompt] = []
        for text in body.prompts:
            prompt = await self.resolver.resolve.remote(who.user, as_chat(body, text))
            check_text_only(prompt)
            prompt.request_id, prompt.sampling, prompt.raw = rid, body.sampling(), True
            prompts.append(prompt)
        cid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        jobs = [(p, i) for p in prompts for i in range(body.n)]  # choice k: jobs[k]
        if body.stream:
            gen = self._completion_sse(body, jobs, cid, created, t0)
            first = await anext(gen)  # errors before the 200 status is sent
            return StreamingResponse(prepend(first, gen), media_type="text/event-stream")
        answers = await asyncio.gather(*(self._collect(p, i) for p, i in jobs))
        choices = []
        for index, ((prompt, _), (text, lps, done, t_first, t_last)) in enumerate(
            zip(jobs, answers, strict=True)
        ):
            self._record(prompt.policy, done, t_first - t0, t_last - t_first)
            choices.append(
                CompletionChoice(
                    index=index,
                    text=text,
                    finish_reason=done.finish_reason,
                    logprobs=completion_logprobs(lps) if body.logprobs is not None else None,
                )
            )
        usage = completion_usage(jobs, [a[2] for a in answers])
        out = Completion(id=cid, created=created, model=body.model, choices=choices, usage=usage)
        return Response(out.model_dump_json(exclude_none=True), media_type="application/json")

    async def _collect(self, prompt: LinkedPrompt, index: int):
        """(text, logprobs, DoneEvent, t_first, t_last) of one choice."""
        text: list[str] = []
        lps: list[TokenLogprob] = []
        done, t_first, t_last = None, 0.0, 0.0
        async for ev in self._generate(prompt, index):
            if isinstance(ev, TokenEvent):
                t_last = time.perf_counter()
                t_first = t_first or t_last
                text.append(ev.text)
                lps.extend(ev.logprobs or [])
            else:
                done = ev
        assert done is not None, "the worker always ends with a DoneEvent"
        t_first = t_first or time.perf_counter()
        return "".join(text), lps, done, t_first, t_last or t_first

    async def _completion_sse(
        self,
        body: CompletionRequest,
        jobs: list[tuple[LinkedPrompt, int]],
        cid: str,
        created: int,
        t0: float,
    ) -> AsyncIterator[str]:
        """The SSE events of every choice (`jobs[k]`: choice k's prompt and its index among its
        prompt's n), merged as they come (`merged`), each naming its choice; then one usage
        event for all (each prompt's tokens counted once) when asked."""

        def event(choice: CompletionChoice | None, usage: Usage | None = None) -> str:
            c = Completion(
                id=cid,
                created=created,
                model=body.model,
                choices=[choice] if choice else [],
                usage=usage,
            )
            return f"data: {c.model_dump_json(exclude_none=True)}\n\n"

        events = merged([self._generate(p, i) for p, i in jobs])
        t_first: dict[int, float] = {}  # choice -> its first piece's time
        offsets = [0] * len(jobs)
        done: dict[int, DoneEvent] = {}  # choice -> its DoneEvent
        try:
            async for k, ev in events:
                if isinstance(ev, TokenEvent):
                    t_first.setdefault(k, time.perf_counter())
                    lps = None
                    if body.logprobs is not None and ev.logprobs:
                        lps = completion_logprobs(ev.logprobs, offsets[k])
                    offsets[k] += len(ev.text)
                    yield event(CompletionChoice(index=k, text=ev.text, logprobs=lps))
                    continue
                first = t_first.setdefault(k, time.perf_counter())
                self._record(jobs[k][0].policy, ev, first - t0, time.perf_counter() - first)
                yield event(CompletionChoice(index=k, text="", finish_reason=ev.finish_reason))
                done[k] = ev
            if body.stream_options and body.stream_options.include_usage:
                yield event(None, completion_usage(jobs, [done[k] for k in range(len(jobs))]))
        except Exception as exc:  # noqa: BLE001 - after the 200: an SSE error event, then close
            if not t_first and not done:
                raise
            if status_of(exc) >= 500:
                logger.exception("stream %s failed", jobs[0][0].request_id)
            yield f"data: {error_body(exc).model_dump_json()}\n\n"
        finally:
            await events.aclose()  # closed early (the client gone): the worker stops now
        yield "data: [DONE]\n\n"
