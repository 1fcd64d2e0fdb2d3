"""`VllmFrontEnd`: what the offline and the async vLLM engines share (process that owns the
engine: CLI, benchmark, Serve replica), the vLLM implementation of `mpic.engine.protocol.Engine`
less its driver: config, model spec, processor, entry store, planning and the request of a
prompt (`prepare`), the request form vLLM is given, uploads and compressed entries, the
failed-link fallback. Each driver (`mpic.engine.vllm.engine.VllmEngine`: offline `LLM`;
`mpic.engine.vllm.async_engine.AsyncVllmEngine`: V1 `AsyncLLM`) starts vLLM and says how one
request runs to its end (`_run_to_end`). The CPU set-up and vLLM's engine arguments are in
`mpic.engine.vllm.startup`, the upload prompts in `mpic.engine.vllm.upload_prompt`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mpic.engine.items import load_image
from mpic.engine.model_dir import resolve_model_dir
from mpic.engine.request_flow import plan_parts, policy_of
from mpic.engine.sampling import stop_ids
from mpic.engine.vllm import params as vllm_params
from mpic.engine.vllm import presses as vllm_presses
from mpic.engine.vllm.config import VllmEngineConfig
from mpic.engine.vllm.requests import (
    EngineRequest,
    exact_request,
    linked_request,
    resolve_fallback,
)
from mpic.engine.vllm.startup import prepare_environment
from mpic.engine.vllm.upload_prompt import (
    UploadForm,
    document_upload_form,
    image_upload_form,
    upload_request,
)
from mpic.errors import CorruptEntryError, InvalidRequestError
from mpic.linker.chat_template import ChatTemplateOptions
from mpic.linker.policies import Policy
from mpic.linker.policies.full import FullPolicy
from mpic.linker.policies.scout_scales import load_table as load_scale_table
from mpic.linker.recipe import PlannedPrompt
from mpic.model_spec import ModelSpec
from mpic.prompt_parts import PromptPart
from mpic.storage.entry_store import EntryStore
from mpic.storage.object_store import ObjectNotFoundError
from mpic.types import CacheEntry

Media = Mapping[str, bytes | Callable[[], bytes]]
"""Entry id -> the item's media bytes, or a function reading them (called only when needed)."""

logger = logging.getLogger(__name__)

__all__ = ["Media", "VllmFrontEnd"]


class VllmFrontEnd:
    """The vLLM backend of `mpic.engine.protocol.Engine`, shared by its two drivers
    (`VllmEngine`: offline `LLM`; `mpic.engine.vllm.async_engine.AsyncVllmEngine`: V1
    `AsyncLLM`): config, model spec, processor, entry store, planning and the request of a
    prompt (`prepare`), request forms, uploads (`mpic.engine.vllm.upload_prompt`) and the
    failed-link fallback."""

    def __init__(self, cfg: VllmEngineConfig) -> None:
        prepare_environment(cfg)
        self.cfg = cfg
        model_dir = resolve_model_dir(cfg.model)
        self.spec = ModelSpec.from_pretrained(model_dir)
        self.scout_scales = load_scale_table(model_dir, self.spec.num_layers)
        """The model's own (budget, S) table for `scout-*` / `auto` names (`mpic model
        calibrate-scout --write`), read as the reference runner reads it; None: the default."""
        self._processor: Any = None
        self.store = EntryStore.from_config(cfg.storage)
        """The entry store (the worker opens the same durable store from `cfg.storage`)."""
        self.fallbacks = 0
        """Linked requests answered by exact recomputation because an entry could not load."""

    def _submit_form(
        self,
        req: EngineRequest,
        max_tokens: int,
        logprobs: bool,
        sampling: dict[str, Any] | None = None,
        ignore_eos: bool = False,
    ) -> tuple[dict, Any]:
        """(prompt, SamplingParams) of one request: greedy, or `sampling`'s SamplingParams
        keywords (temperature, top_p, seed, penalties, logit_bias, logprobs, ignore_eos) over
        that. Decoding stops at the model's end ids (`ModelSpec.end_token_ids`: config,
        generation config and the chat template's end token, the ids the reference runner stops
        at), the EOS token included in the output; `ignore_eos` (benchmarks, or a request that
        asks for it) decodes `max_tokens` whatever comes."""
        from vllm import SamplingParams

        prompt: dict[str, Any] = {"prompt_token_ids": list(req.prompt_token_ids)}
        if req.multi_modal_data:
            prompt["multi_modal_data"] = req.multi_modal_data
        extra = None
        if req.plan is not None:
            params = vllm_params.plan_to_params(req.plan, req.policy)
            prompt["cache_salt"] = vllm_params.cache_salt(params)
            extra = {"kv_transfer_params": params}
        if req.cache_salt is not None:
            prompt["cache_salt"] = req.cache_salt
        params: dict[str, Any] = dict(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=ignore_eos,
            extra_args=extra,
            logprobs=-1 if logprobs else None,
            detokenize=False,  # token ids only: `mpic.engine.request_flow.TextStream` says them
        )
        params.update(sampling or {})
        own = params.get("stop_token_ids") or []
        params["stop_token_ids"] = stop_ids(own, self.spec.end_token_ids, params["ignore_eos"])
        return prompt, SamplingParams(**params)

    @property
    def prefix_cache(self) -> bool:
        """Whether vLLM keeps its own prefix cache across requests (optional `Engine` member:
        a benchmark repeating a prompt salts it, `GenerateRequest.cache_salt`)."""
        return self.cfg.enable_prefix_caching

    def worker_cpu_s(self) -> float:
        """CPU seconds used so far by vLLM's worker process(es), where the model runs (optional
        `Engine` member: a busy shared host makes wall-clock time noisy; CPU time still
        measures the work)."""
        import psutil

        total = 0.0
        for child in psutil.Process().children(recursive=True):
            try:
                if child.name().startswith("VLLM::Worker"):
                    times = child.cpu_times()
                    total += times.user + times.system
            except psutil.NoSuchProcess:
                continue
        return total

    @staticmethod
    def link_failed(req: EngineRequest, finish_reason: str | None) -> bool:
        """True when vLLM finished a linked request with an error: its entries did not load
        (`kv_load_failure_policy="fail"`)."""
        return req.plan is not None and finish_reason not in (None, "length", "stop")

    def _fallbacks(self, failed: list[EngineRequest]) -> list[EngineRequest]:
        """The exact requests answering `failed` linked ones (logged, counted);
        CorruptEntryError when one carries no fallback."""
        missing = [i for i, r in enumerate(failed) if r.fallback is None]
        if missing:
            raise CorruptEntryError(
                f"linked requests {missing} could not load their entries "
                "and carry no exact fallback"
            )
        self.fallbacks += len(failed)
        logger.warning(
            "MPIC: %d linked request(s) could not link; recomputing exactly", len(failed)
        )
        return [resolve_fallback(r) for r in failed]

    @property
    def processor(self) -> Any:
        """The model's HF processor (chat template, tokenizer), loaded once."""
        if self._processor is None:
            from transformers import AutoProcessor

            self._processor = AutoProcessor.from_pretrained(self.spec.path)
        return self._processor

    def plan(
        self,
        parts: Sequence[PromptPart],
        policy: str | Policy = "full",
        max_new_tokens: int = 0,
        system_prompt: str | None = None,
        *,
        entries: Mapping[str, CacheEntry] | None = None,
        raw: bool = False,
        template: ChatTemplateOptions | None = None,
    ) -> PlannedPrompt:
        """The finished link plan of `parts` (`mpic.engine.request_flow.plan_parts`) under
        `policy` (a name parsed here, `policy_of`), rendered with the chat template's options
        `template` (None: the default rendering)."""
        table = {} if entries is None else entries
        rule = self.policy_of(policy)
        spec, processor = self.spec, self.processor
        return plan_parts(
            spec, processor, parts, table, rule, system_prompt, max_new_tokens, raw, template
        )

    def prepare(
        self,
        parts: Sequence[PromptPart],
        entries: Mapping[str, CacheEntry],
        policy: str | Policy,
        system_prompt: str | None = None,
        max_new_tokens: int = 0,
        *,
        raw: bool = False,
        template: ChatTemplateOptions | None = None,
        media: Media | None = None,
        exact: bool = False,
        salt: str | None = None,
    ) -> tuple[PlannedPrompt, EngineRequest]:
        """(plan, vLLM request) of a prompt: the linked request under `policy` (a name parsed
        here once, `policy_of`; its canonical name is what the request carries to vLLM's
        processes), its exact fallback, built only if the link fails, carrying the images of
        `media` when given; or with `exact` plain vLLM over the prompt planned under `full`
        with its images (no linking). raw, template: how the prompt is rendered (`plan`'s).
        salt: the prefix-cache salt (a fresh one: no prefix-cache hit)."""
        rule = FullPolicy() if exact else self.policy_of(policy)
        planned = self.plan(
            parts, rule, max_new_tokens, system_prompt, entries=entries, raw=raw, template=template
        )

        def exact_form() -> EngineRequest:  # documents' token ids are in the plan's prompt
            return exact_request(planned.plan, self.spec.image_token_id, images())

        def images() -> list[Any]:
            found = media or {}
            try:
                return [
                    load_image(m() if callable(m := found[r]) else m)
                    for r in planned.refs
                    if entries[r].media_type == "image"
                ]
            except ObjectNotFoundError:
                raise InvalidRequestError("an entry and its media are gone") from None

        if exact:
            request = exact_form()
        else:
            fallback = exact_form if media is not None else None
            request = linked_request(planned.plan, rule.name, self.spec, fallback=fallback)
        if salt is not None:
            request.cache_salt = salt
        return planned, request

    def policy_of(self, policy: str | Policy) -> Policy:
        """A request's policy: a name parsed once, against the model's own scout scales
        (`scout_scales`, as the reference runner parses it); a policy object as given."""
        return policy_of(policy, self.scout_scales)

    def policy_name(self, policy: str | Policy) -> str:
        """The name a linked request carries to vLLM's processes (its `kv_transfer_params`,
        msgpack: names travel, objects do not): the policy's canonical name, the model's own
        scout scales spelled out (`auto` -> `scout-0.18:s<S>`), so the connector's halves, which
        parse it once per request in vLLM's processes, use the S the reference runner uses."""
        return self.policy_of(policy).name

    def _run_to_end(self, prompt: dict, sampling: Any) -> None:
        """Run one vLLM request (an upload or a compression) to its end, blocking the calling
        thread: each driver's own way (`LLM.generate`, or `AsyncLLM` on its loop)."""
        raise NotImplementedError

    def cache_image(self, media: bytes, system_prompt: str | None = None) -> CacheEntry:
        """Upload path (blocks the calling thread): the image's entry computed by vLLM's own
        forward (batched with requests in flight on the async engine), written to the store by
        the connector and read back."""
        return self._store_entry(self._upload_form(media, system_prompt))

    def cache_document(self, text: str, system_prompt: str | None = None) -> CacheEntry:
        """Upload path of a text document (blocks the calling thread): its entry (the KV of its
        own token ids after its canonical context) computed by vLLM, written to the store."""
        return self._store_entry(self._document_form(text, system_prompt))

    def _store_entry(self, form: UploadForm) -> CacheEntry:
        """Run an upload prompt (`_upload_form` / `_document_form`) through vLLM
        (`mpic.engine.vllm.upload_prompt.upload_request`) and read back the entry its worker
        stored for the item's tokens."""
        self._run_to_end(*upload_request(self.spec.fingerprint, *form))
        return self.store.get(form[3])

    def press_entry(self, entry: CacheEntry, press: str, budget: float) -> CacheEntry:
        """`entry` compressed by `press` at `budget` (uniform across layers), made by vLLM's
        worker on first use and stored beside the full entry (blocks the calling thread;
        `mpic.engine.vllm.presses`)."""
        return vllm_presses.press_entry(self, entry, press, budget, self._run_to_end)

    def _upload_form(self, media: bytes, system_prompt: str | None) -> UploadForm:
        """An image's canonical upload prompt (`mpic.engine.vllm.upload_prompt
        .image_upload_form`) under the engine's context limit."""
        limit = self.cfg.max_model_len
        return image_upload_form(self.processor, self.spec, media, system_prompt, limit)

    def _document_form(self, text: str, system_prompt: str | None) -> UploadForm:
        """A text document's canonical upload prompt (`mpic.engine.vllm.upload_prompt
        .document_upload_form`) under the engine's context limit."""
        limit = self.cfg.max_model_len
        return document_upload_form(self.processor, self.spec, text, system_prompt, limit)
