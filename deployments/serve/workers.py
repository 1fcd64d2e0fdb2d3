"""The Encoder and LLM-worker deployments (Serve replicas that hold a model).

Encoder: image bytes -> `EncodedImage` (content hash + input embeddings [T, hidden]); its result
travels to the worker as a Ray ObjectRef (zero-copy inside a node), never through HTTP.
LLMWorker: computes an upload's entry and registers it in the static library (entries are
written through to the object store, so other nodes read them by key), and generates from a
`LinkedPrompt` by the policy the Resolver parsed (`LinkedPrompt.parsed_policy`, not parsed here
again): it loads the linked entries through the tiered entry store (memory -> disk ->
object store), recomputes any entry that is lost or corrupt from its stored media (a fallback),
and streams the engine's `TokenEvent`s and final `DoneEvent` (an async generator holding no
lock: requests in flight reach the engine together; sync methods run on Serve's threads).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any, Literal

from mpic.deployments.config import ServeAppConfig
from mpic.deployments.engines.engine import build_engine
from mpic.deployments.engines.tokenization import detokenize, tokenize_chat, tokenize_text
from mpic.deployments.file_schemas import FileObject
from mpic.deployments.messages import DoneEvent, EncodedImage, LinkedPrompt, Segment, TokenEvent
from mpic.deployments.monitoring.fidelity_monitor import FidelityMonitor
from mpic.deployments.monitoring.metrics import CompileMetricsExporter, StoreMetricsExporter
from mpic.deployments.monitoring.replica_logs import use_serve_logging
from mpic.deployments.monitoring.vllm_metrics import RunningGauge
from mpic.deployments.serve.admission import (
    EngineBudget,
    EngineHealth,
    is_engine_death,
    worker_capacity,
)
from mpic.deployments.serve.files import FileLostError, Sweeper, file_object, open_library
from mpic.deployments.serve.image_limits import check_image_pixels
from mpic.deployments.serve.inline import resolve_inline
from mpic.deployments.serve.policy_check import check_layers, check_policy, model_layers
from mpic.documents import decode_document
from mpic.errors import MPICError
from mpic.linker.chat_template import ChatTemplateOptions
from mpic.storage.entry_store import EntryStore
from mpic.storage.keys import entry_object_key
from mpic.storage.object_store import ObjectNotFoundError
from mpic.storage.parallel_fetch import FetchError, fetch_entries
from mpic.storage.static_library import media_key
from mpic.types import CacheEntry

logger = logging.getLogger(__name__)


class Encoder:
    """Vision tower + projector behind `POST /v1/files` and inline images."""

    def __init__(self, config: ServeAppConfig) -> None:
        use_serve_logging()
        self.engine = build_engine(config.engine, config.store, "encoder")
        self.limits = config.limits

    def encode(self, image_bytes: bytes) -> EncodedImage:
        """Decode (415 if not an image) and encode one image; before decoding, from its header:
        413 over `limits.max_image_pixels` pixels (decompression bombs), 400 over
        `limits.max_image_side` or `limits.max_image_aspect_ratio` (resize bombs)."""
        return encode_checked(self.engine, self.limits, image_bytes)


def encode_checked(engine: Any, lim: Any, image_bytes: bytes) -> EncodedImage:
    """`Encoder.encode` on `engine` with the `limits` section `lim` (also the LLM worker's
    re-encoding of an inline image whose encoding was lost in transit)."""
    check_image_pixels(
        image_bytes, lim.max_image_pixels, lim.max_image_side, lim.max_image_aspect_ratio
    )
    return engine.encode_image(image_bytes)


def _num_gpu_blocks(engine: Any) -> int | None:
    """The KV blocks a started vLLM engine reports (its cache config), else None."""
    llm = getattr(getattr(engine, "vllm", None), "llm", None)
    cache = getattr(getattr(llm, "vllm_config", None), "cache_config", None)
    try:
        blocks = int(getattr(cache, "num_gpu_blocks", None) or 0)
    except (TypeError, ValueError):
        return None
    return blocks or None


class LLMWorker:
    """The engine that owns KV: caches uploads and runs linked prefill + decode."""

    def __init__(self, config: ServeAppConfig, check_policy_layers: bool = False) -> None:
        """`check_policy_layers`: the app builder could not read the model's layer count (its
        folder is on the GPU nodes only), so the Resolver left per-layer policy ratios unchecked
        and `generate` checks them against this replica's own read of it."""
        use_serve_logging()
        self.cfg = config
        self.engine = build_engine(config.engine, config.store, "worker")
        self.policy_layers = model_layers(config.engine) if check_policy_layers else None
        self.entries = EntryStore.from_config(config.store)
        self.library = open_library(config.store, self.entries)
        self.sweeper = Sweeper(self.library, config.sweep_interval_s)
        self.store_metrics = StoreMetricsExporter(self.entries.metrics)
        self.compile_metrics = CompileMetricsExporter()
        requests, tokens = worker_capacity(config, _num_gpu_blocks(self.engine))
        self.budget = EngineBudget(requests, tokens, config.limits.retry_after_s)
        self.health = EngineHealth(self.engine)
        self.running = RunningGauge(config.engine.served_names[0])
        self.fidelity = FidelityMonitor(
            config.fidelity, self.engine, lambda: self.budget.requests, config.recompute_budget
        )

    def check_health(self) -> None:
        """Serve's health check (every `health_check_period_s`): fails once the engine died, so
        Serve replaces this replica (requests meanwhile get 503 with Retry-After)."""
        self.health.check()

    def sweep(self, grace_s: float | None = None) -> dict:
        """Run the file sweeper now (admin route; `grace_s` None: the configured grace); its
        report."""
        return self.sweeper.sweep_now(grace_s).model_dump()

    def upload(
        self,
        user: str,
        name: str,
        image: EncodedImage,
        ttl_s: float | None,
        purpose: Literal["vision", "user_data"] = "vision",
    ) -> FileObject:
        """Compute `image`'s canonical KV and register the file in `user`'s namespace."""
        entry = self.engine.compute_entry(self.engine.entry_id(image.media), image)
        return self._register(user, name, image.media_type, image.media, entry, ttl_s, purpose)

    def upload_document(
        self,
        user: str,
        name: str,
        data: bytes,
        media_type: str,
        ttl_s: float | None,
        purpose: Literal["vision", "user_data"] = "user_data",
    ) -> FileObject:
        """Compute a text document's canonical KV (415 unless UTF-8; 400 if empty) and register
        the file in `user`'s namespace: same isolation, TTL and storage as an image."""
        entry = self.engine.compute_document_entry(decode_document(data))
        return self._register(user, name, media_type, data, entry, ttl_s, purpose)

    def _register(
        self,
        user: str,
        name: str,
        media_type: str,
        media: bytes,
        entry: CacheEntry,
        ttl_s: float | None,
        purpose: Literal["vision", "user_data"],
    ) -> FileObject:
        """Register an uploaded file with its computed entry in `user`'s namespace."""
        rec = self.library.add_file(
            user,
            name=name,
            media_type=media_type,
            media=media,
            entry=entry,
            ttl_s=ttl_s,
            purpose=purpose,
            entry_stored=self.engine.stores_entries,
        )
        self._count_engine_write(entry)
        self.store_metrics.export()
        return file_object(rec)

    def _count_engine_write(self, entry: CacheEntry) -> None:
        """An engine that stores entries itself (vLLM's connector writes from vLLM's worker
        process) bypasses this replica's store: count the entry's object bytes as written, so
        `mpic_store_written_bytes` grows on upload as with the other engines."""
        objects = self.entries.objects
        if not self.engine.stores_entries or objects is None:
            return
        try:
            size = objects.stat(entry_object_key(entry.entry_id)).size
        except ObjectNotFoundError:
            return
        self.entries.metrics.bytes_written.labels("object").inc(size)

    def tokenize(
        self,
        prompt: str | None,
        messages: list[dict] | None,
        add_special_tokens: bool | None = None,
        template: ChatTemplateOptions | None = None,
        return_token_strs: bool = False,
    ) -> tuple[list[int], list[str] | None]:
        """vLLM's `/tokenize` on the served model (`mpic.deployments.engines.tokenization`): (ids,
        token strings when asked)."""
        tok = self.engine.text_tokenizer
        if prompt is not None:
            special = True if add_special_tokens is None else add_special_tokens
            ids = tokenize_text(tok, prompt, special)
        else:
            ids = tokenize_chat(tok, messages or [], self.cfg.engine.system_prompt, template)
        strs = None
        if return_token_strs:
            strs = tok.convert_ids_to_tokens(ids) if tok is not None else [chr(i) for i in ids]
        return ids, strs

    def detokenize(self, tokens: list[int]) -> str:
        """vLLM's `/detokenize` on the served model."""
        return detokenize(self.engine.text_tokenizer, tokens)

    def context_length(self) -> int:
        """The served context length (`max_model_len` of /v1/models and /tokenize)."""
        return self.engine.context_length()

    def fingerprint(self) -> str:
        """The served model's fingerprint (dynamic-library refreshes record it)."""
        return self.engine.fingerprint

    def make_entry(self, media: bytes) -> CacheEntry:
        """The canonical entry of an image (dynamic-library refresh); not stored here."""
        return self.engine.compute_entry(
            self.engine.entry_id(media), self.engine.encode_image(media)
        )

    def make_document_entry(self, text: str) -> CacheEntry:
        """The canonical entry of a text passage (dynamic-library refresh); not stored here."""
        return self.engine.compute_document_entry(text)

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve's routing-stats hook (polled every `request_routing_stats_period_s`): the entry
        ids this replica's memory and disk tiers hold, the mean seconds it took to load an
        entry from each tier (`load_s`: memory, disk, remote), whether the memory tier is full
        (`memory_full`: less free than its mean entry, so admitting a missed entry evicts one)
        and when this report was taken (`at`, wall time), so `mpic.deployments.serve.router`
        costs a miss by where the entry lives and by the eviction it causes."""
        disk, memory = self.entries.disk, self.entries.memory
        resident = memory.keys()
        mean_entry = memory.used / len(resident) if resident else 0.0
        metrics = self.entries.metrics
        load_s = {
            name: metrics.mean_load_s(tier)
            for name, tier in (("memory", "memory"), ("disk", "disk"), ("remote", "object"))
        }
        return {
            "at": time.time(),
            "memory": resident,
            "memory_full": bool(resident) and memory.capacity - memory.used < mean_entry,
            "disk": disk.keys() if disk else [],
            "load_s": {k: v for k, v in load_s.items() if v is not None},
        }

    def engine_stats(self) -> dict[str, int]:
        """The engine's own counters (vLLM: `peak_running`, `fallbacks`) and the admission
        budget's (`requests_in_flight`, `tokens_in_flight`, `budget_rejected`)."""
        return {**self.engine.engine_stats(), **self.budget.stats()}

    @staticmethod
    def cost(prompt: LinkedPrompt) -> int:
        """Tokens a prompt will hold at most, estimated before any entry loads: max_tokens +
        one per 2 characters of text + 1024 per inline image (linked entries are already
        computed; their KV is counted by the memory tier)."""
        tokens = prompt.max_tokens
        for turn in prompt.turns:
            for seg in turn.segments:
                if seg.kind == "text":
                    tokens += len(seg.text or "") // 2 + 1
                elif seg.kind != "entry":
                    tokens += 1024
        return tokens

    async def generate(self, prompt: LinkedPrompt) -> AsyncIterator[TokenEvent | DoneEvent]:
        """Stream the answer to `prompt`. Inline images arrive as ObjectRefs (one lost in
        transit is encoded here again, `mpic.deployments.serve.inline`); linked entries load in
        parallel from the fastest tier (on a thread), lost ones are recomputed from their media.
        No lock: concurrent calls reach the engine together (vLLM batches them).

        Admission: 503 while the engine is dead, 429 past the replica's budget (before any
        entry loads). Cancellation: when the caller goes away (client disconnect: Serve cancels
        this generator), the engine's generator is closed at once, which aborts the request in
        the engine (vLLM's abort; the reference engine's decode thread stops) and frees its KV."""
        if self.health.dead():
            raise self.health.unavailable()
        self.fidelity.default_policy(prompt)
        if self.policy_layers is not None:  # the Resolver could not check the layers (400)
            if prompt.parsed_policy is not None:  # its parse, checked here: no second parse
                check_layers(prompt.parsed_policy.get(), self.policy_layers)
            else:  # a prompt built without the Resolver
                check_policy(prompt.policy, self.policy_layers)
        shadow: dict | None = {} if self.fidelity.wants(prompt) else None
        try:
            with self.budget.admit(self.cost(prompt)):
                self.running.set(self.budget.requests)
                async for ev in self._generate(prompt, shadow):
                    yield ev
        finally:  # the answer is out and the request left the budget: its shadow, if sampled
            self.running.set(self.budget.requests)
            if shadow:
                self.fidelity.submit(prompt, shadow["entries"], shadow["served"])

    def fidelity_stats(self) -> dict:
        """The fidelity monitor's shadow counts, sampled drift and loop budget."""
        return self.fidelity.stats()

    async def _generate(
        self, prompt: LinkedPrompt, shadow: dict | None = None
    ) -> AsyncIterator[TokenEvent | DoneEvent]:
        """shadow: for a request sampled by the fidelity monitor, receives its `entries` and
        the `served` first-token distribution (stripped from the DoneEvent)."""
        reencoded = await resolve_inline(
            prompt, lambda data: encode_checked(self.engine, self.cfg.limits, data),
            prompt.request_id,
        )  # fmt: skip
        segs = {s.entry_id: s for t in prompt.turns for s in t.segments if s.kind == "entry"}
        keys = list(segs)
        store = self.cfg.store
        try:
            got = await asyncio.to_thread(
                fetch_entries,
                self.entries,
                keys,
                lambda k: self._recompute(segs[k], prompt.request_id),
                pin=True,
                max_workers=store.load_workers,
                load_timeout_s=store.load_timeout_s,
            )
        except FetchError as exc:  # a typed cause (the media is gone too: 410) is the answer
            if isinstance(exc.__cause__, MPICError):
                raise exc.__cause__ from None
            raise
        self.store_metrics.export()
        with got:
            tiers = Counter(src for src in got.sources if src != "computed")
            entries = dict(zip(keys, got.entries, strict=True))
            events = self.engine.generate(prompt, entries)
            try:
                async for ev in events:
                    if isinstance(ev, DoneEvent):
                        ev.tier_hits = dict(tiers)
                        ev.fallbacks += len(got.fallbacks) + reencoded
                        ev.policy = prompt.policy  # the name it was resolved to
                        if shadow is not None:
                            shadow.update(entries=entries, served=ev.first_token)
                        ev.first_token = None
                        self.compile_metrics.export()
                    yield ev
            except MPICError:
                raise
            except Exception as exc:
                if not is_engine_death(exc):
                    raise
                self.health.mark_dead(exc)
                logger.error("request %s: the engine died (%s)", prompt.request_id, exc)
                raise self.health.unavailable() from None
            finally:
                aclose = getattr(events, "aclose", None)
                if aclose is not None:
                    await aclose()  # a cut-short stream aborts the engine's request

    def _recompute(self, seg: Segment, request_id: str) -> CacheEntry:
        """A lost or corrupt entry, recomputed from the media the library keeps (a fallback,
        logged as a WARNING with the request id); 410 when the media is gone too."""
        logger.warning(
            "request %s: file %s (entry %s) is lost or corrupt; recomputing it from its media",
            request_id,
            seg.file_id or "-",
            seg.entry_id,
            extra={"request_id": request_id, "file_id": seg.file_id, "entry_id": seg.entry_id},
        )
        try:
            media = self.entries.objects.get(media_key(seg.content_hash))
        except ObjectNotFoundError:
            raise FileLostError(
                f"the cached data and the media of entry {seg.entry_id} are lost; upload the "
                "image again"
            ) from None
        if seg.document:
            return self.engine.compute_document_entry(decode_document(media))
        return self.engine.compute_entry(seg.entry_id, self.engine.encode_image(media))
