"""`ServeEngine` on the HF reference runner (Encoder and LLM-worker replicas, `engine.kind:
reference`): the same linking path as `mpic.engine.reference_runner` offline, so an HTTP answer
equals the offline engine's for the same prompt and policy.

The runner is not thread-safe and keeps a table of linkable entries; Serve runs sync replica
methods on worker threads, so every call into the runner holds one lock, and the entries of a
request are made linkable for that request only (inline images included: their entry is computed
for the request and never stored).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator

import torch

from mpic.deployments.config import EngineConfig
from mpic.deployments.engine import (
    DoneEvent,
    EncodedImage,
    LinkedPrompt,
    Role,
    ServeEngine,
    TokenEvent,
)
from mpic.engine.entries import canonical_context_key, compute_entry
from mpic.engine.reference_runner import ReferenceRunner
from mpic.engine.vision import encode_images, load_image
from mpic.errors import InvalidRequestError
from mpic.linker.policies import get_policy
from mpic.linker.prompt import ImageRef, PromptPart, canonical_context_ids
from mpic.storage.config import StorageConfig
from mpic.storage.entry_codec import entry_key
from mpic.types import CacheEntry

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ReferenceServeEngine(ServeEngine):
    """The reference runner behind the serving deployments (CPU, or CUDA when present)."""

    def __init__(self, cfg: EngineConfig, store: StorageConfig, role: Role) -> None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.cfg = cfg
        self.runner = ReferenceRunner(cfg.model, device, _DTYPES[cfg.dtype], cfg.system_prompt)
        spec = self.runner.spec
        self._context_ids = canonical_context_ids(
            self.runner.processor, cfg.system_prompt, spec.image_token_id
        )
        self._lock = threading.Lock()

    @property
    def fingerprint(self) -> str:
        """The model fingerprint."""
        return self.runner.spec.fingerprint

    def encode_image(self, image_bytes: bytes) -> EncodedImage:
        """Decode (415 if not an image) and run vision tower + projector: [T, hidden]."""
        image = load_image(image_bytes)
        with self._lock, torch.inference_mode():
            (embeds,) = encode_images(self.runner.model, self.runner.processor, [image])
        fmt = _image_format(image_bytes)
        return EncodedImage(image_bytes, hashlib.sha256(image_bytes).hexdigest(),
                            f"image/{fmt}", embeds.detach().cpu())

    def entry_id(self, media: bytes) -> str:
        """Content address over (fingerprint, canonical context, media bytes)."""
        return entry_key(self.fingerprint, canonical_context_key(self._context_ids), media)

    def compute_entry(self, entry_id: str, image: EncodedImage) -> CacheEntry:
        """KV of [canonical context + image] (a plain prefill of those tokens)."""
        with self._lock:
            return compute_entry(self.runner.adapter, self.runner.spec, self._context_ids,
                                 image.input_embeds, entry_id)

    def check_policy(self, policy: str) -> None:
        """InvalidRequestError listing the valid names for an unknown policy."""
        try:
            get_policy(policy)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="mpic.policy") from exc

    def generate(
        self, prompt: LinkedPrompt, entries: dict[str, CacheEntry]
    ) -> Iterator[TokenEvent | DoneEvent]:
        """Greedy generation through the runner's link + selective prefill + decode."""
        parts: list[PromptPart] = []
        table = dict(entries)
        for turn in prompt.turns:
            if turn.role == "system":
                if turn.segments and "".join(s.text for s in turn.segments) != (
                        self.cfg.system_prompt or ""):
                    raise InvalidRequestError(
                        "this deployment serves one system prompt (engine.system_prompt); "
                        "omit the system message or send exactly that text", param="messages")
                continue
            if turn.role == "assistant":
                raise InvalidRequestError("assistant turns (multi-turn chats) are not supported",
                                          param="messages")
            for seg in turn.segments:
                if seg.kind == "text":
                    parts.append(seg.text)
                    continue
                if seg.kind == "inline":
                    inline = seg.embeds
                    seg.entry_id = f"inline-{inline.content_hash}"
                    table[seg.entry_id] = self.compute_entry(seg.entry_id, inline)
                parts.append(ImageRef(seg.entry_id))
        with self._lock:
            self.runner.entries = table
            try:
                gen = self.runner.generate(parts, prompt.policy, prompt.max_tokens)
            finally:
                self.runner.entries = {}
        pre = gen.prefilled
        tokenizer = self.runner.processor.tokenizer
        text = ""
        for i in range(len(gen.tokens)):  # one event per token (incremental detokenization)
            piece = tokenizer.decode(gen.tokens[: i + 1], skip_special_tokens=True)
            yield TokenEvent(piece[len(text):] if piece.startswith(text) else piece)
            text = piece
        plan = pre.plan
        stored = torch.tensor([not e.startswith("inline-") for e in plan.entry_ids] + [False])
        reused = (plan.recompute_depth < self.runner.adapter.num_layers) & stored[plan.source_entry]
        reused = int(reused.sum())  # linked tokens of stored entries (inline images: not cached)
        yield DoneEvent(
            prompt_tokens=pre.plan.num_tokens, cached_tokens=reused,
            completion_tokens=len(gen.tokens),
            finish_reason="length" if len(gen.tokens) >= prompt.max_tokens else "stop",
            ttft_s=pre.ttft_s,
        )


def _image_format(data: bytes) -> str:
    from io import BytesIO

    from PIL import Image

    with Image.open(BytesIO(data)) as img:
        return (img.format or "octet-stream").lower()
