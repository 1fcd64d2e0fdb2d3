"""The small engine interface the Encoder and LLM-worker deployments drive (Serve replicas).

Ray Serve LLM keeps its engine behind an ABC so the deployment graph does not care which engine
runs; MPIC does the same: `ServeEngine` is implemented by thin adapters over the two backends of
`mpic.engine.protocol.Engine`, the HF reference runner
(`mpic.deployments.engines.reference_engine`) and vLLM + the MPIC connector
(`mpic.deployments.engines.vllm_serve_engine`), and by a model-free fake
(`mpic.deployments.engines.fake_engine`), chosen by the engine config's `kind` through
`build_engine`.

The Resolver (`mpic.deployments.serve.resolver`) hands the worker a `LinkedPrompt`
(`mpic.deployments.messages`): the chat turns with every file reference already resolved to a
content-addressed entry id in the caller's namespace. The worker
builds the link plan next to the KV (policies such as CacheBlend read the linked keys) and streams
`TokenEvent`s followed by one `DoneEvent` from the engine's async generator: the worker holds no
lock, so an engine that batches (vLLM's `AsyncLLM`) serves concurrent requests together.
"""

from __future__ import annotations

import asyncio
import importlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, Literal

from mpic.deployments.config import EngineConfig
from mpic.deployments.messages import DoneEvent, EncodedImage, LinkedPrompt, TokenEvent
from mpic.errors import InvalidRequestError, UnreadableMediaError
from mpic.storage.config import StorageConfig
from mpic.types import CacheEntry

if TYPE_CHECKING:
    from mpic.engine.first_token import FirstToken
    from mpic.engine.protocol import Engine, GenerateRequest


class ServeEngine(ABC):
    """An engine as the serving deployments see it."""

    stores_entries: bool = False
    """True when `compute_entry` leaves the entry in the configured store itself (the vLLM
    connector writes it from vLLM's worker process), so the LLM worker does not write it again."""

    @property
    @abstractmethod
    def fingerprint(self) -> str:
        """The model fingerprint (part of every entry id)."""

    @abstractmethod
    def encode_image(self, image_bytes: bytes) -> EncodedImage:
        """Decode and encode one image (vision tower + projector).

        Raises UnreadableMediaError (415) when the bytes are not an image."""

    @abstractmethod
    def entry_id(self, media: bytes) -> str:
        """The content-addressed entry id of an image in this model's canonical context
        (`mpic.addressing.entry_address` over fingerprint, context, media bytes)."""

    @abstractmethod
    def compute_entry(self, entry_id: str, image: EncodedImage) -> CacheEntry:
        """The KV of [canonical context + image] as a CacheEntry named `entry_id`."""

    def compute_document_entry(self, text: str) -> CacheEntry:
        """The KV of [canonical context + a text document] (an uploaded .txt/.md file), named by
        its content address. Engines that do not cache documents answer 415."""
        raise UnreadableMediaError(
            f"the {type(self).__name__} engine does not cache text documents; serve with the "
            "reference or the vLLM engine",
            param="file",
        )

    @property
    @abstractmethod
    def backend(self) -> Engine:
        """The `mpic.engine.protocol.Engine` that generates (the LLM-worker role's)."""

    @abstractmethod
    def request_of(self, prompt: LinkedPrompt, entries: dict[str, CacheEntry]) -> GenerateRequest:
        """The backend's request for `prompt` over `entries` (every id of `prompt.entry_ids`,
        loaded by the worker): its parts (`mpic.deployments.engines.prompting
        .generate_request`), inline images' entries computed for it alone. Blocking: called on
        a thread."""

    async def generate(
        self, prompt: LinkedPrompt, entries: dict[str, CacheEntry]
    ) -> AsyncIterator[TokenEvent | DoneEvent]:
        """Async generator, the same for every engine: `request_of` (on a thread), then the
        backend's `Engine.generate` (link `entries`, prefill selectively by the prompt's policy:
        the Resolver's parse, `LinkedPrompt.parsed_policy`, else its name; decode by
        `prompt.sampling`: every field honoured), one TokenEvent per piece as it is
        decoded and a closing DoneEvent (its `fallbacks`: entries the backend recomputed; the
        worker adds its tier_hits and own fallbacks). Closing it stops the backend's work.
        InvalidRequestError for a prompt over the context length."""
        request = await asyncio.to_thread(self.request_of, prompt, entries)
        async with aclosing(self.backend.generate(request)) as events:
            async for event in events:
                yield event

    def engine_stats(self) -> dict[str, int]:
        """Engine-specific counters for tests and operators (none by default)."""
        return {}

    def close(self) -> None:  # noqa: B027 (a hook: most engines start nothing)
        """Stop what the engine started (processes, threads); nothing by default."""

    @property
    def text_tokenizer(self) -> Any:
        """The served model's HF text tokenizer (`/tokenize`, `/detokenize`); None for an
        engine without a model (UTF-8 bytes stand for tokens then)."""
        return None

    def context_length(self) -> int:
        """The context length requests are held to (`max_model_len` of `/v1/models`)."""
        limit = getattr(self.cfg, "max_model_len", None) if hasattr(self, "cfg") else None
        return int(limit or 4096)

    supports_fidelity: bool = False
    """True when `generate` honours `LinkedPrompt.capture_first_token` and `exact_pass` runs
    (the live fidelity monitor, docs/fidelity.md)."""

    async def exact_pass(
        self,
        prompt: LinkedPrompt,
        entries: dict[str, CacheEntry],
        served: FirstToken,
        answer_tokens: int = 0,
    ) -> FirstToken:
        """An exact pass (policy `full`) of `prompt`, off the critical path: its first-token
        distribution (logits [V], or the logprobs of `served.token_ids` where the engine
        returns logprobs only: vLLM) and, with `answer_tokens` > 0, its greedy answer of that
        many tokens at most (`FirstToken.answer`, stopping after an end id)."""
        raise NotImplementedError(f"{type(self).__name__} runs no fidelity shadows")


ENGINES = {
    "reference": "mpic.deployments.engines.reference_engine:ReferenceServeEngine",
    "vllm": "mpic.deployments.engines.vllm_serve_engine:VllmServeEngine",
    "fake": "mpic.deployments.engines.fake_engine:FakeServeEngine",
}
"""Built-in engine names; `engine.kind` may also be any 'package.module:Class' path."""


Role = Literal["encoder", "worker"]
"""An Encoder replica only calls `encode_image`; an engine may skip loading what it then needs
not (the vLLM engine starts no vLLM in an encoder)."""


def build_engine(cfg: EngineConfig, store: StorageConfig, role: Role) -> ServeEngine:
    """Instantiate the engine `cfg.kind` names: a built-in name or a 'module:Class' path
    (imported lazily: vLLM only when asked), on the model folder with `cfg.chat_template` when
    one is set (`mpic.engine.hf.chat_template`). InvalidRequestError for a path that does not
    name a `ServeEngine` subclass."""
    if cfg.chat_template and cfg.kind in ("reference", "vllm"):  # vLLM's --chat-template
        from mpic.engine.hf.chat_template import with_chat_template
        from mpic.engine.model_dir import resolve_model_dir

        folder = with_chat_template(resolve_model_dir(cfg.model), cfg.chat_template)
        cfg = cfg.model_copy(update={"model": folder})
    module, _, name = ENGINES.get(cfg.kind, cfg.kind).partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise InvalidRequestError(f"engine.kind {cfg.kind!r}: {exc}", param="engine.kind") from exc
    if not (isinstance(cls, type) and issubclass(cls, ServeEngine)):
        raise InvalidRequestError(
            f"engine.kind {cfg.kind!r} is not a ServeEngine subclass", param="engine.kind"
        )
    return cls(cfg, store, role)
