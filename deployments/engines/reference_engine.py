"""`ServeEngine` on the HF reference runner (Encoder and LLM-worker replicas, `engine.kind:
reference`): the same linking path as `mpic.engine.hf.reference_runner` offline, so an HTTP answer
equals the offline engine's for the same prompt and policy.

A thin adapter over the reference backend of `mpic.engine.protocol.Engine`: tokens are streamed
as the runner decodes them (`ReferenceRunner.stream`, on one decode thread per request that hands
each token straight to the event loop and does not wait for the consumer), with the request's
own system prompt, sampled by `mpic.engine.sampling.Sampler` and turned into text by the shared
`mpic.engine.request_flow.TextStream`. The runner is not thread-safe, so every call into it holds
one lock (the LLM worker holds none; requests wait for the lock on their own decode threads, and
one whose client left stops waiting or decoding at once: `generate`), and the entries of a
request are linkable for that request only (passed to the runner with it; inline images
included: their entry is computed for the request and never stored).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from mpic.addressing import entry_address
from mpic.deployments.config import EngineConfig
from mpic.deployments.engines.engine import Role, ServeEngine
from mpic.deployments.engines.first_token import FirstToken
from mpic.deployments.engines.prompting import INLINE_PREFIX, identify_image, prompt_parts
from mpic.deployments.messages import DoneEvent, EncodedImage, LinkedPrompt, TokenEvent
from mpic.engine.hf.entries import cache_document, compute_entry
from mpic.engine.hf.reference_runner import Prefilled, ReferenceRunner
from mpic.engine.hf.vision import encode
from mpic.engine.items import load_image
from mpic.engine.request_flow import TextStream, done_event, finish_reason
from mpic.engine.sampling import Sampler
from mpic.engine.token_bytes import TokenBytes
from mpic.linker.prompt import canonical_context_ids, tokenizer_of
from mpic.prompt_parts import PromptPart
from mpic.storage.config import StorageConfig
from mpic.types import CacheEntry

logger = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ReferenceServeEngine(ServeEngine):
    """The reference runner behind the serving deployments (CPU, or CUDA when present)."""

    def __init__(self, cfg: EngineConfig, store: StorageConfig, role: Role) -> None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.cfg = cfg
        self.runner = ReferenceRunner(
            cfg.model,
            device,
            _DTYPES[cfg.dtype],
            cfg.system_prompt,
            link_prefix=cfg.link_prefix,
        )
        spec = self.runner.spec
        self._context_ids = (  # a text-only model caches documents only
            canonical_context_ids(self.runner.processor, cfg.system_prompt, spec.image_token_id)
            if spec.takes_images
            else []
        )
        self._lock = threading.Lock()
        self.token_bytes = TokenBytes(tokenizer_of(self.runner.processor))  # logprob bytes

    @property
    def fingerprint(self) -> str:
        """The model fingerprint."""
        return self.runner.spec.fingerprint

    @property
    def text_tokenizer(self) -> Any:
        """The model's HF text tokenizer."""
        return tokenizer_of(self.runner.processor)

    def context_length(self) -> int:
        """The configured `max_model_len`, else the model's position limit."""
        return int(self.cfg.max_model_len or self.runner.spec.max_model_len)

    def encode_image(self, image_bytes: bytes) -> EncodedImage:
        """Decode (415 if not an image) and run vision tower + projector: [T, hidden]."""
        content_hash, media_type = identify_image(image_bytes)
        with self._lock, torch.inference_mode():
            (features,) = encode(
                self.runner.model, self.runner.processor, [load_image(image_bytes)]
            )
        extra = {} if features.grid_thw is None else {"image_grid_thw": list(features.grid_thw)}
        embeds = features.embeds.detach().cpu()
        return EncodedImage(image_bytes, content_hash, media_type, embeds, extra)

    def entry_id(self, media: bytes) -> str:
        """Content address over (fingerprint, canonical context, media bytes)."""
        return entry_address(self.fingerprint, self._context_ids, media)

    def compute_entry(self, entry_id: str, image: EncodedImage) -> CacheEntry:
        """KV of [canonical context + image] (a plain prefill of those tokens)."""
        with self._lock:
            return compute_entry(
                self.runner.adapter,
                self.runner.spec,
                self._context_ids,
                image.input_embeds,
                entry_id,
                grid_thw=image.extra.get("image_grid_thw"),
            )

    def compute_document_entry(self, text: str) -> CacheEntry:
        """KV of [canonical context + document] (`mpic.engine.hf.entries.cache_document`)."""
        with self._lock:
            return cache_document(
                self.runner.processor,
                self.runner.adapter,
                self.runner.spec,
                text,
                self.cfg.system_prompt,
            )

    supports_fidelity = True

    async def exact_first_token(
        self, prompt: LinkedPrompt, entries: dict[str, CacheEntry], served: FirstToken
    ) -> FirstToken:
        """Policy `full` over the same prompt (its system prompt, entries and inline images):
        the first-token logits [V], on a thread under the runner's lock."""
        return await asyncio.to_thread(self._exact_first_token, prompt, entries)

    def _parts(
        self, prompt: LinkedPrompt, entries: dict[str, CacheEntry]
    ) -> tuple[str | None, list[PromptPart], dict[str, CacheEntry]]:
        """(system prompt, parts, entry table) of a request: `entries` plus its inline images'
        entries, computed for this request alone (blocking: call on a thread)."""
        table = dict(entries)

        def inline_entry(image: EncodedImage) -> str:
            entry_id = INLINE_PREFIX + image.content_hash
            table[entry_id] = self.compute_entry(entry_id, image)
            return entry_id

        system, parts = prompt_parts(prompt, self.cfg.system_prompt, inline_entry)
        return system, parts, table

    def _exact_first_token(
        self, prompt: LinkedPrompt, entries: dict[str, CacheEntry]
    ) -> FirstToken:
        system, parts, table = self._parts(prompt, entries)
        with self._lock:
            pre = self.runner.prefill(
                parts, "full", 0, system_prompt=system, entries=table, raw=prompt.raw
            )
        return FirstToken.from_logits(pre.logits)

    async def generate(
        self, prompt: LinkedPrompt, entries: dict[str, CacheEntry]
    ) -> AsyncIterator[TokenEvent | DoneEvent]:
        """Link + selective prefill + decode on a decode thread (`_decode`), one event per token
        as it is decoded, tokens picked by the request's `Sampler` (greedy at temperature 0;
        seeded sampling, top_p, penalties, logit_bias, logprobs) and cut at a stop string
        (`mpic.engine.request_flow.TextStream`). The thread hands each token over through an
        asyncio queue, so the event loop never waits on the runner, and a consumer that goes
        away (the client left: Serve cancels the worker's generator, or closes it) or a stop
        string sets `gone` at once: a request still queued for the runner never prefills and a
        running one stops decoding after its current step (the runner is free for the next)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        gone = threading.Event()

        def put(item: object) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:  # the loop is gone: nobody listens any more
                gone.set()

        args = (prompt, entries, gone, put)
        threading.Thread(target=self._decode, args=args, name="mpic-decode", daemon=True).start()
        logger.debug("request %s: decoding", prompt.request_id)
        text = TextStream(tokenizer_of(self.runner.processor), prompt.sampling.stop)
        prefilled: Prefilled | None = None
        try:
            while (item := await events.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                token, prefilled, logprobs = item
                yield text.push([token], logprobs)
                if text.stopped:
                    break
            if (rest := text.flush()) is not None:
                yield rest
        finally:
            gone.set()
        if prefilled is None:  # abandoned before its prefill: nobody waits for a DoneEvent
            return
        tokens, pre = text.tokens, prefilled
        ended = bool(tokens) and tokens[-1] in self.runner.spec.end_token_ids
        length = len(tokens) >= prompt.max_tokens and not (ended and not prompt.sampling.ignore_eos)
        yield done_event(
            pre.plan,
            len(tokens),
            finish_reason(text.stopped, length),
            pre.ttft_s,
            prompt.policy,
            first_token=FirstToken.from_logits(pre.logits) if prompt.capture_first_token else None,
        )

    @contextmanager
    def _runner_for(self, stop: Callable[[], bool]) -> Iterator[bool]:
        """Hold the runner; yields False (without it) once `stop()` is true while waiting."""
        while not self._lock.acquire(timeout=0.02):
            if stop():
                yield False
                return
        try:
            yield True
        finally:
            self._lock.release()

    def _decode(
        self,
        prompt: LinkedPrompt,
        entries: dict[str, CacheEntry],
        gone: threading.Event,
        put: Callable[[object], None],
    ) -> None:
        """On the decode thread: the request's parts (inline images' entries computed for it
        alone), then the runner's stream under its lock at the runner's pace, each (token,
        prefill, logprobs) `put` as decoded, an exception put as it is raised, then None.
        Stops at once when `gone` is set (before the prefill when still waiting)."""
        try:
            system, parts, table = self._parts(prompt, entries)
            tokenizer = tokenizer_of(self.runner.processor)
            sampler = Sampler(prompt.sampling, lambda i: tokenizer.decode([i]), self.token_bytes)
            with self._runner_for(gone.is_set) as held:
                if not held or gone.is_set():  # abandoned while queued: no prefill at all
                    return
                for token, pre in self.runner.stream(
                    parts,
                    prompt.policy,
                    prompt.max_tokens,
                    system_prompt=system,
                    pick=sampler,
                    press=prompt.press,
                    budget=prompt.budget,
                    stop_at_eos=not prompt.sampling.ignore_eos,
                    entries=table,
                    raw=prompt.raw,  # a completion: no chat template (mpic.linker.raw_prompt)
                ):
                    put((token, pre, sampler.take()))
                    if gone.is_set():
                        break
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            put(exc)
        finally:
            put(None)
