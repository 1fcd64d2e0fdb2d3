"""What the offline and the async vLLM engines share (process that owns the engine):
`VllmEngineConfig`, the CPU set-up, vLLM's engine arguments with the MPIC connector, and
`VllmFrontEnd`. vLLM's engine core and worker (child processes) load
`mpic.engine.vllm.connector.kv_connector` and the plugin `mpic.engine.vllm.plugin` themselves.

Every CPU set-up step (docs/design.md "Platform notes") lives in `prepare_environment`:
- `VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache) from `VllmEngineConfig.kv_cache_gib`;
- `VLLM_WORKER_MULTIPROC_METHOD=spawn`: vLLM's children are spawned, never forked from a process
  that already runs torch threads (callers' scripts need `if __name__ == "__main__":`);
- float32 on CPU (bf16 is ~5x slower on these AVX2 cores) and `block_size` a multiple of 32
  (the CPU attention kernel's requirement), both enforced by the config;
- the torchvision shim for CPU torch is NOT here: it must run at interpreter start-up, so
  scripts/setup.sh installs it as a `.pth` (scripts/torchvision_cpu_shim.py documents it).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mpic.engine.items import (
    check_item_length,
    document_item,
    image_item,
    image_layout,
    line_break_offsets,
    load_image,
)
from mpic.engine.model_dir import resolve_model_dir
from mpic.engine.request_flow import plan_parts, policy_of
from mpic.engine.vllm import params as vllm_params
from mpic.engine.vllm import presses as vllm_presses
from mpic.engine.vllm import upload as vllm_upload
from mpic.engine.vllm.config import VllmEngineConfig
from mpic.engine.vllm.requests import (
    EngineRequest,
    exact_request,
    linked_request,
    resolve_fallback,
)
from mpic.engine.vllm.version import check_vllm_version
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

CONNECTOR = "MPICConnector"
CONNECTOR_MODULE = "mpic.engine.vllm.connector.kv_connector"

__all__ = ["CONNECTOR", "CONNECTOR_MODULE", "VllmEngineConfig", "VllmFrontEnd", "engine_kwargs"]


def prepare_environment(cfg: VllmEngineConfig) -> None:
    """Check the installed vLLM's release (`mpic.engine.vllm.version`: stops outside the tested
    range unless overridden) and set the process environment vLLM reads at start-up (see the
    module docstring)."""
    check_vllm_version(cfg.allow_untested_vllm)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gib)
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def engine_kwargs(cfg: VllmEngineConfig) -> dict[str, Any]:
    """vLLM `EngineArgs` keywords for `cfg` (the offline `LLM` and `AsyncEngineArgs` take the
    same): the MPIC connector (`kv_load_failure_policy="fail"`: a failed link errors the request,
    the caller answers it exactly) and the CPU-friendly settings."""
    from vllm.config import KVTransferConfig

    kv_transfer = None
    if cfg.linking:
        kv_transfer = KVTransferConfig(
            kv_connector=CONNECTOR,
            kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_both",
            kv_load_failure_policy="fail",
            kv_connector_extra_config={
                "storage": cfg.storage.model_dump(mode="json"),
                "async_loads": cfg.async_loads,
                "batch_links": cfg.batch_links,
                "link_share": cfg.link_share,
                "link_prefix": cfg.link_prefix,
            },
        )
    optional = {
        "num_gpu_blocks_override": cfg.num_blocks,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
    }
    return dict(
        model=resolve_model_dir(cfg.model),  # a local folder, or the local copy of an S3 prefix
        dtype=cfg.dtype,
        block_size=cfg.block_size,
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        enable_prefix_caching=cfg.enable_prefix_caching,
        enforce_eager=cfg.enforce_eager,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        tensor_parallel_size=cfg.tensor_parallel_size,
        seed=cfg.seed,
        kv_transfer_config=kv_transfer,
        limit_mm_per_prompt={"image": 16},
        disable_log_stats=not cfg.log_stats,
        max_logprobs=cfg.max_logprobs,
        **{k: v for k, v in optional.items() if v is not None},
    )


class VllmFrontEnd:
    """The vLLM backend of `mpic.engine.protocol.Engine`, shared by its two drivers
    (`VllmEngine`: offline `LLM`; `mpic.engine.vllm.async_engine.AsyncVllmEngine`: V1
    `AsyncLLM`): config, model spec, processor, entry store, planning and the request of a
    prompt (`prepare`), request forms, the upload prompt and the failed-link fallback."""

    def __init__(self, cfg: VllmEngineConfig) -> None:
        prepare_environment(cfg)
        self.cfg = cfg
        model_dir = resolve_model_dir(cfg.model)
        self.spec = ModelSpec.from_pretrained(model_dir)
        self.scout_scales = load_scale_table(model_dir)
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
        )
        params.update(sampling or {})
        if not params["ignore_eos"]:  # vLLM checks stop_token_ids even with ignore_eos
            params["stop_token_ids"] = list(self.spec.end_token_ids)
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

    def _store_entry(self, form: tuple) -> CacheEntry:
        """Run an upload prompt (`_upload_form` / `_document_form`: ids, multi-modal data or
        None, span, entry id, extra) through vLLM and read back the entry its worker stored for
        the tokens [span)."""
        self._run_to_end(*self._entry_form(*form))
        return self.store.get(form[3])

    def press_entry(self, entry: CacheEntry, press: str, budget: float) -> CacheEntry:
        """`entry` compressed by `press` at `budget` (uniform across layers), made by vLLM's
        worker on first use and stored beside the full entry (blocks the calling thread;
        `mpic.engine.vllm.presses`)."""
        return vllm_presses.press_entry(self, entry, press, budget, self._run_to_end)

    def _upload_form(
        self, media: bytes, system_prompt: str | None
    ) -> tuple[list[int], dict[str, Any], tuple[int, int], str, dict[str, Any]]:
        """(ids, multi-modal data, span, entry id, extra) of an image's canonical upload prompt:
        same canonical context, processor-exact image and content address as the reference runner
        (`mpic.engine.items.image_item`), so both engines name an image's entry alike; the
        span and grid are the image's own (`vision.image_layout`); PromptTooLongError over the
        engine's context limit."""
        image, context, entry_id = image_item(self.processor, self.spec, media, system_prompt)
        layout = image_layout(self.processor, image)
        ids = context + [self.spec.image_token_id]
        if self.spec.vision_end_id is not None:
            ids.append(self.spec.vision_end_id)
        extra: dict[str, Any] = {"context_token_ids": list(context)}
        if layout.grid_thw is not None:
            extra["image_grid_thw"] = list(layout.grid_thw)
        limit = self.cfg.max_model_len or self.spec.max_model_len
        check_item_length("image", len(context), layout.num_tokens, limit)
        span = (len(context), len(context) + layout.num_tokens)
        return ids, {"image": image}, span, entry_id, extra

    def _document_form(
        self, text: str, system_prompt: str | None
    ) -> tuple[list[int], None, tuple[int, int], str, dict[str, Any]]:
        """(ids, None, span, entry id, extra) of a text document's canonical upload prompt
        (its canonical context, then its own token ids): the same token ids, content address and
        `extra` as the reference runner's entry (`mpic.engine.items.document_item`);
        InvalidRequestError when empty, PromptTooLongError over the engine's context limit."""
        limit = self.cfg.max_model_len or self.spec.max_model_len
        doc, context, entry_id = document_item(
            self.processor, self.spec, text, system_prompt, max_len=limit
        )
        extra: dict[str, Any] = {
            "context_token_ids": list(context),
            "token_ids": list(doc),
            "line_breaks": line_break_offsets(self.processor, doc),
        }
        span = (len(context), len(context) + len(doc))
        return context + doc, None, span, entry_id, extra

    def _entry_form(
        self,
        prompt_token_ids: list[int],
        multi_modal_data: dict[str, Any] | None,
        span: tuple[int, int],
        entry_id: str,
        extra: dict[str, Any] | None = None,
    ) -> tuple[dict, Any]:
        """The vLLM request that stores the KV of its expanded prompt's tokens [span) as
        `entry_id` (`mpic.engine.vllm.upload`; a unique salt: the prefix cache never skips it).
        No multi-modal data: a text document's entry (media type "text")."""
        from vllm import SamplingParams

        media_type = "image" if multi_modal_data else "text"
        params = vllm_upload.upload_params(
            entry_id, self.spec.fingerprint, *span, media_type=media_type, extra=extra
        )
        prompt: dict[str, Any] = {
            "prompt_token_ids": list(prompt_token_ids),
            "cache_salt": f"mpic-upload-{entry_id}-{uuid.uuid4().hex}",
        }
        if multi_modal_data:
            prompt["multi_modal_data"] = multi_modal_data
        sampling = SamplingParams(
            temperature=0.0, max_tokens=1, extra_args={"kv_transfer_params": params}
        )
        return prompt, sampling
