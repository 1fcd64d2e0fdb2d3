"""`ServeEngine` on vLLM + the MPIC KV connector (Encoder and LLM-worker replicas,
`engine.kind: vllm`), wrapping `mpic.engine.vllm_engine.VllmEngine`.

vLLM runs its own vision tower inside the request that computes an entry (the upload path of
`mpic.engine.vllm_upload`), so the Encoder replica here only validates and identifies the image
(no vLLM is started for role "encoder") and the worker computes the entry from the bytes. A query
is linked as in the reference runner (render -> plan -> policy depths) and submitted as a linked
request whose KV the connector assembles from the shared entry store inside vLLM's worker.

`VllmEngine.generate` drives vLLM's offline `LLM` and returns whole generations, so calls are
serialised by a lock and the tokens are streamed after the generation ends; TTFT reported by the
engine is the time of the whole call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from mpic.deployments.config import EngineConfig
from mpic.deployments.engine import (
    DoneEvent,
    EncodedImage,
    LinkedPrompt,
    Role,
    ServeEngine,
    TokenEvent,
)
from mpic.deployments.prompting import (
    identify_image,
    prompt_parts,
    stored_linked_tokens,
    token_events,
)
from mpic.engine.entries import canonical_context_key
from mpic.engine.model_spec import ModelSpec
from mpic.linker.plan import build_plan, resolve_entries, unique_entries
from mpic.linker.policies import get_policy
from mpic.linker.prompt import canonical_context_ids, image_refs, render_prompt_ids
from mpic.storage.config import StorageConfig
from mpic.storage.entry_codec import entry_key
from mpic.types import CacheEntry


class VLLMServeEngine(ServeEngine):
    """vLLM (CPU or GPU) with MPIC linking behind the serving deployments."""

    def __init__(self, cfg: EngineConfig, store: StorageConfig, role: Role) -> None:
        from transformers import AutoProcessor

        self.cfg = cfg
        self.spec = ModelSpec.from_pretrained(cfg.model)
        self.processor = AutoProcessor.from_pretrained(cfg.model)
        context = canonical_context_ids(self.processor, cfg.system_prompt, self.spec.image_token_id)
        self._context_key = canonical_context_key(context)
        self._lock = threading.Lock()
        self.vllm = None
        if role == "worker":
            from mpic.engine.vllm_engine import VllmEngine, VllmEngineConfig

            self.vllm = VllmEngine(
                VllmEngineConfig(model=cfg.model, dtype=cfg.dtype, storage=store)
            )

    @property
    def fingerprint(self) -> str:
        """The model fingerprint."""
        return self.spec.fingerprint

    def encode_image(self, image_bytes: bytes) -> EncodedImage:
        """Validate (415) and identify the image; vLLM encodes it inside `compute_entry`."""
        content_hash, media_type = identify_image(image_bytes)
        return EncodedImage(image_bytes, content_hash, media_type, None)

    def entry_id(self, media: bytes) -> str:
        """Content address over (fingerprint, canonical context, media bytes)."""
        return entry_key(self.spec.fingerprint, self._context_key, media)

    def compute_entry(self, entry_id: str, image: EncodedImage) -> CacheEntry:
        """The canonical entry computed by vLLM's own forward (written to the store)."""
        assert self.vllm is not None, "compute_entry runs in the LLM worker"
        with self._lock:
            entry = self.vllm.cache_image(image.media, self.cfg.system_prompt)
        assert entry.entry_id == entry_id, "vLLM and the serving layer name entries alike"
        return entry

    def generate(
        self, prompt: LinkedPrompt, entries: dict[str, CacheEntry]
    ) -> Iterator[TokenEvent | DoneEvent]:
        """Link by `prompt.policy` and decode greedily through vLLM + the MPIC connector."""
        from mpic.engine.vllm_requests import linked_request

        assert self.vllm is not None, "generate runs in the LLM worker"
        table = dict(entries)

        def inline_entry(image: EncodedImage) -> str:  # stored by the connector: vLLM loads it
            entry = self.compute_entry(self.entry_id(image.media), image)
            table[entry.entry_id] = entry
            return entry.entry_id

        system, parts = prompt_parts(prompt, self.cfg.system_prompt, inline_entry)
        start = time.perf_counter()
        ids = render_prompt_ids(self.processor, parts, system)
        items = resolve_entries(image_refs(parts), table)
        plan = build_plan(self.spec, ids, items, prompt.max_tokens)
        plan = get_policy(prompt.policy).apply(
            plan, unique_entries(plan, items), self.spec.num_layers
        )
        with self._lock:
            (result,) = self.vllm.generate(
                [linked_request(plan, prompt.policy, self.spec)], prompt.max_tokens
            )
        elapsed = time.perf_counter() - start
        yield from token_events(self.processor.tokenizer, result.token_ids)
        yield DoneEvent(
            prompt_tokens=plan.num_tokens,
            cached_tokens=stored_linked_tokens(plan),
            completion_tokens=len(result.token_ids),
            finish_reason="length" if len(result.token_ids) >= prompt.max_tokens else "stop",
            ttft_s=elapsed,
        )
