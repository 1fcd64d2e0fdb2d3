"""`ServeEngine` on vLLM + the MPIC KV connector (Encoder and LLM-worker replicas,
`engine.kind: vllm`), a thin adapter over `mpic.engine.vllm.async_engine.AsyncVllmEngine` (vLLM
V1's `AsyncLLM`; the vLLM backend of `mpic.engine.protocol.Engine`): it turns a served prompt
into the backend's request (`request_of`, with what the exact fallback reads), and the backend
plans, links and decodes it (`AsyncVllmEngine.decode`); generation is `ServeEngine.generate`,
the same for every engine.

vLLM runs its own vision tower inside the request that computes an entry (the upload path of
`mpic.engine.vllm.upload`), so the Encoder replica here only validates and identifies the image
(no vLLM is started for role "encoder") and the worker computes the entry from the bytes; a text
document's entry is computed by vLLM's forward over its token ids alike. A query
is linked as in the reference runner (render -> plan -> policy depths) and submitted as a linked
request whose KV the connector assembles from the shared entry store inside vLLM's worker.
A request with a press (`mpic.press`/`mpic.budget`) links its images' and documents' compressed
entries (`mpic.engine.vllm.presses`: the presses' uniform-across-layers variant, fewer tokens per
item).

No lock: every query is its own vLLM request, streamed token by token as vLLM decodes it, and
vLLM's scheduler batches the requests in flight (continuous batching). A linked request whose
entries vLLM's worker cannot load is answered by its exact fallback (the prompt with its images,
read from the store only then), reported in the DoneEvent's `fallbacks`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from mpic.addressing import entry_address
from mpic.deployments.config import EngineConfig
from mpic.deployments.engines.engine import Role, ServeEngine
from mpic.deployments.engines.prompting import generate_request, identify_image
from mpic.deployments.messages import EncodedImage, LinkedPrompt
from mpic.engine.first_token import FirstToken
from mpic.engine.protocol import Engine, GenerateRequest
from mpic.engine.vllm.requests import resolve_fallback
from mpic.errors import InvalidRequestError
from mpic.linker.prompt import canonical_context_ids, tokenizer_of
from mpic.model_spec import ModelSpec
from mpic.storage.config import StorageConfig
from mpic.storage.static_library import media_key
from mpic.types import CacheEntry


class VllmServeEngine(ServeEngine):
    """vLLM (CPU or GPU) with MPIC linking behind the serving deployments."""

    def __init__(self, cfg: EngineConfig, store: StorageConfig, role: Role) -> None:
        from transformers import AutoProcessor

        self.cfg = cfg
        self.spec = ModelSpec.from_pretrained(cfg.model)
        self.processor = AutoProcessor.from_pretrained(cfg.model)
        self._context_ids = (  # a text-only model caches documents only
            canonical_context_ids(self.processor, cfg.system_prompt, self.spec.image_token_id)
            if self.spec.takes_images
            else []
        )
        self.vllm = None
        if role == "worker":
            from mpic.engine.vllm.async_engine import AsyncVllmEngine
            from mpic.engine.vllm.config import VllmEngineConfig, VllmOptions

            options = cfg.model_dump(include=set(VllmOptions.model_fields))
            self.vllm = AsyncVllmEngine(
                VllmEngineConfig(
                    **options, model=cfg.model, storage=store, link_prefix=cfg.link_prefix
                )
            )

    def close(self) -> None:
        """Stop vLLM's engine processes (the worker role's; idempotent)."""
        if self.vllm is not None:
            self.vllm.close()
            self.vllm = None

    @property
    def fingerprint(self) -> str:
        """The model fingerprint."""
        return self.spec.fingerprint

    def encode_image(self, image_bytes: bytes) -> EncodedImage:
        """Validate (415) and identify the image; vLLM encodes it inside `compute_entry`.
        InvalidRequestError (400) for a text-only model."""
        if not self.spec.takes_images:
            raise InvalidRequestError("this model takes no images (a text-only model)")
        content_hash, media_type = identify_image(image_bytes)
        return EncodedImage(image_bytes, content_hash, media_type, None)

    def entry_id(self, media: bytes) -> str:
        """Content address over (fingerprint, canonical context, media bytes)."""
        return entry_address(self.spec.fingerprint, self._context_ids, media)

    stores_entries = True

    def compute_entry(self, entry_id: str, image: EncodedImage) -> CacheEntry:
        """The canonical entry computed by vLLM's own forward; the connector writes it to the
        store from vLLM's worker process and it is read back once here (this replica's memory
        tier then holds it for planning). Blocks the calling thread, batched with the queries in
        flight."""
        assert self.vllm is not None, "compute_entry runs in the LLM worker"
        entry = self.vllm.cache_image(image.media, self.cfg.system_prompt)
        assert entry.entry_id == entry_id, "vLLM and the serving layer name entries alike"
        return entry

    def compute_document_entry(self, text: str) -> CacheEntry:
        """A text document's canonical entry computed by vLLM's own forward (its token ids after
        the canonical context; same ids, address and `extra` as the reference engine's), written
        to the store by the connector. Blocks the calling thread."""
        assert self.vllm is not None, "compute_document_entry runs in the LLM worker"
        return self.vllm.cache_document(text, self.cfg.system_prompt)

    @property
    def text_tokenizer(self) -> Any:
        """The model's HF text tokenizer."""
        return tokenizer_of(self.processor)

    def context_length(self) -> int:
        """vLLM's `max_model_len` (the configured one, else the model's)."""
        if self.vllm is not None:
            return int(self.vllm.llm.model_config.max_model_len)
        return int(self.cfg.max_model_len or self.spec.max_model_len)

    def engine_stats(self) -> dict[str, int]:
        """vLLM's batching and fallback counters: `peak_running` (most requests its scheduler
        ran in one step) and `fallbacks` (linked requests answered exactly)."""
        assert self.vllm is not None, "engine_stats runs in the LLM worker"
        return {"peak_running": self.vllm.peak_running, "fallbacks": self.vllm.fallbacks}

    @property
    def backend(self) -> Engine:
        """vLLM's async engine, the vLLM backend of `mpic.engine.protocol.Engine`."""
        assert self.vllm is not None, "the backend runs in the LLM worker"
        return self.vllm

    def request_of(self, prompt: LinkedPrompt, entries: dict[str, CacheEntry]) -> GenerateRequest:
        """The backend's request, with what its exact fallback reads (each entry's media from
        the store, only if the link fails); inline images' entries are computed by vLLM and
        stored by the connector (vLLM loads them like any other). Blocking: on a thread."""
        media: dict[str, Callable[[], bytes]] = {}
        for turn in prompt.turns:
            for seg in turn.segments:
                if seg.kind == "entry":
                    key = media_key(seg.content_hash)
                    media[seg.entry_id] = lambda key=key: self.vllm.store.objects.get(key)

        def inline_entry(image: EncodedImage) -> CacheEntry:
            entry = self.compute_entry(self.entry_id(image.media), image)
            media[entry.entry_id] = lambda: image.media
            return entry

        scales = getattr(self.vllm, "scout_scales", None)
        return generate_request(
            prompt, self.cfg.system_prompt, entries, inline_entry, media, scales=scales
        )

    supports_fidelity = True

    async def exact_pass(
        self,
        prompt: LinkedPrompt,
        entries: dict[str, CacheEntry],
        served: FirstToken,
        answer_tokens: int = 0,
    ) -> FirstToken:
        """The exact prompt (the linked request's own exact fallback: every token computed by
        vLLM, press off), greedy, with the raw first-token logprobs of exactly the served pass's
        top-k token ids (`logprob_token_ids`: vLLM returns logprobs, not logits) and, when
        asked, its answer of `answer_tokens` tokens at most."""
        assert self.vllm is not None, "exact_pass runs in the LLM worker"
        plain = dataclasses.replace(prompt, press=None, budget=None, capture_first_token=False)
        request = await asyncio.to_thread(self.request_of, plain, entries)
        _, linked = await asyncio.to_thread(self.vllm.linked, request)
        exact = await asyncio.to_thread(resolve_fallback, linked)
        ids = list(served.token_ids or [served.top1])
        sampling = {"temperature": 0.0, "logprobs": len(ids), "logprob_token_ids": ids}
        first, answer = None, []
        stream = self.vllm.stream(exact, max(answer_tokens, 1), sampling)
        try:
            async for result in stream:
                answer = list(result.token_ids)
                if first is None and answer and (steps := result.extra.get("logprobs")):
                    step = steps[0]
                    first = FirstToken(
                        top1=int(answer[0]),
                        token_ids=ids,
                        logprobs=[float(step[t].logprob) for t in ids],
                    )
        finally:
            await stream.aclose()
        if first is None:
            raise RuntimeError("vLLM returned no first-token logprobs for the exact pass")
        if answer_tokens > 0:
            first.answer = answer
        return first
