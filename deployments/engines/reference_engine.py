"""`ServeEngine` on the HF reference runner (Encoder and LLM-worker replicas, `engine.kind:
reference`): the same linking path as `mpic.engine.hf.reference_runner` offline, so an HTTP answer
equals the offline engine's for the same prompt and policy.

A thin adapter over the reference backend of `mpic.engine.protocol.Engine`
(`mpic.engine.hf.engine.ReferenceEngine`: the runner under one lock, each generation decoded
on a thread of its own): it encodes uploads and computes entries under the backend's lock, and
turns a served prompt into the backend's request (`request_of`; the entries of a request are
linkable for that request only, inline images included: their entry is computed for the
request and never stored). Generation is `ServeEngine.generate`, the same for every engine.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from mpic.addressing import entry_address
from mpic.deployments.config import EngineConfig
from mpic.deployments.engines.engine import Role, ServeEngine
from mpic.deployments.engines.prompting import INLINE_PREFIX, generate_request, identify_image
from mpic.deployments.messages import EncodedImage, LinkedPrompt
from mpic.engine.first_token import FirstToken
from mpic.engine.hf.engine import ReferenceEngine
from mpic.engine.hf.entries import cache_document, compute_entry
from mpic.engine.hf.reference_runner import ReferenceRunner
from mpic.engine.hf.vision import encode
from mpic.engine.items import load_image
from mpic.engine.protocol import GenerateRequest
from mpic.linker.policies.full import FullPolicy
from mpic.linker.prompt import canonical_context_ids, tokenizer_of
from mpic.storage.config import StorageConfig
from mpic.types import CacheEntry

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
        self.engine = ReferenceEngine(self.runner)
        """The backend: every call into the runner holds its lock."""

    @property
    def backend(self) -> ReferenceEngine:
        """The reference backend of `mpic.engine.protocol.Engine`."""
        return self.engine

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
        with self.engine.held() as runner, torch.inference_mode():
            (features,) = encode(runner.model, runner.processor, [load_image(image_bytes)])
        extra = {} if features.grid_thw is None else {"image_grid_thw": list(features.grid_thw)}
        embeds = features.embeds.detach().cpu()
        return EncodedImage(image_bytes, content_hash, media_type, embeds, extra)

    def entry_id(self, media: bytes) -> str:
        """Content address over (fingerprint, canonical context, media bytes)."""
        return entry_address(self.fingerprint, self._context_ids, media)

    def compute_entry(self, entry_id: str, image: EncodedImage) -> CacheEntry:
        """KV of [canonical context + image] (a plain prefill of those tokens)."""
        with self.engine.held() as runner:
            return compute_entry(
                runner.adapter,
                runner.spec,
                self._context_ids,
                image.input_embeds,
                entry_id,
                grid_thw=image.extra.get("image_grid_thw"),
            )

    def compute_document_entry(self, text: str) -> CacheEntry:
        """KV of [canonical context + document] (`mpic.engine.hf.entries.cache_document`)."""
        with self.engine.held() as runner:
            return cache_document(
                runner.processor,
                runner.adapter,
                runner.spec,
                text,
                self.cfg.system_prompt,
            )

    supports_fidelity = True

    async def exact_pass(
        self,
        prompt: LinkedPrompt,
        entries: dict[str, CacheEntry],
        served: FirstToken,
        answer_tokens: int = 0,
    ) -> FirstToken:
        """Policy `full` over the same prompt (its system prompt, entries and inline images):
        the first-token logits [V] and, when asked, the greedy answer; on a thread under the
        runner's lock."""
        return await asyncio.to_thread(self._exact_pass, prompt, entries, answer_tokens)

    def request_of(self, prompt: LinkedPrompt, entries: dict[str, CacheEntry]) -> GenerateRequest:
        """The backend's request: `entries` plus the prompt's inline images' entries, computed
        for this request alone (blocking: called on a thread)."""

        def inline_entry(image: EncodedImage) -> CacheEntry:
            return self.compute_entry(INLINE_PREFIX + image.content_hash, image)

        scales = self.runner.scout_scales
        return generate_request(
            prompt, self.cfg.system_prompt, entries, inline_entry, scales=scales
        )

    def _exact_pass(
        self, prompt: LinkedPrompt, entries: dict[str, CacheEntry], answer_tokens: int
    ) -> FirstToken:
        request = self.request_of(prompt, entries)
        with self.engine.held() as runner:
            steps = list(
                runner.stream(
                    request.parts,
                    FullPolicy(),
                    max(answer_tokens, 1),
                    system_prompt=request.system_prompt,
                    entries=request.entries,
                    raw=request.raw,
                    template=request.template,
                )
            )
        exact = FirstToken.from_logits(steps[0][1].logits)
        if answer_tokens > 0:
            exact.answer = [token for token, _ in steps]
        return exact
