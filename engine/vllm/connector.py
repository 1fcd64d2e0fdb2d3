"""The MPIC KV connector for vLLM V1 (scheduler side in the engine core, worker side in the worker).

Loaded by vLLM through `KVTransferConfig(kv_connector="MPICConnector",
kv_connector_module_path="mpic.engine.vllm.connector")` (see `mpic.engine.vllm.engine`).
vLLM builds one instance per role, in different processes:

- SCHEDULER (engine core): a request whose `kv_transfer_params` carry an MPIC link plan
  (`mpic.engine.vllm.params`) gets every prompt token but the last claimed as externally computed
  (`get_num_new_matched_tokens`), so vLLM schedules only the last prompt token. After block
  allocation the request is queued; `build_connector_meta` ships, per step, each queued request's
  block ids and plan to the worker (`MPICConnectorMetadata`). Preempted requests come back through
  `get_num_new_matched_tokens` when they are rescheduled and are linked again into their new
  blocks (`scheduled_cached_reqs.resumed_req_ids`).
- WORKER: `start_load_kv` runs before the model forward of that step. For each linked request it
  rebuilds the plan, loads the cache entries, and runs the linker's `link_and_prefill` (policy,
  text-first pass of two-step policies, rotated entry KV, one-pass selective prefill) over the
  prompt with vLLM's own modules (`VllmLayerAdapter`), writing every position's K/V into the
  request's paged blocks (`PagedLinkedKV`). vLLM's forward then computes token N-1 over those
  blocks and decodes as usual (continuous batching). A request whose params also carry
  `mpic_press` is an item's canonical prompt: its prefill is observed and the item's compressed
  entry is written to the store (`mpic.engine.vllm.presses`).

The worker reaches the model through `mpic.engine.vllm.plugin.current_runner()`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.forward_context import get_forward_context

from mpic.engine.hf.compress import press_item_entry
from mpic.engine.vllm import params as vllm_params
from mpic.engine.vllm import presses as vllm_presses
from mpic.engine.vllm import upload as vllm_upload
from mpic.engine.vllm.adapter import VllmLayerAdapter
from mpic.engine.vllm.paged_kv import PagedLinkedKV
from mpic.engine.vllm.plugin import current_runner
from mpic.errors import MPICError
from mpic.linker.pipeline import link_and_prefill
from mpic.linker.policies import get_policy
from mpic.linker.recipe import PlannedPrompt
from mpic.storage.config import StorageConfig
from mpic.storage.entry_store import EntryStore
from mpic.storage.object_store import ObjectNotFoundError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


@dataclass
class LinkJob:
    """One linked request to materialise in this step (scheduler -> worker)."""

    req_id: str
    token_ids: list[int]
    """The prompt token ids (N)."""
    block_ids: list[int]
    """All the request's KV blocks, in order."""
    params: dict[str, Any]
    """The request's `kv_transfer_params`."""


@dataclass
class MPICConnectorMetadata(KVConnectorMetadata):
    """Per-step connector metadata: the linked requests whose KV the worker writes this step."""

    jobs: list[LinkJob] = field(default_factory=list)
    uploads: dict[str, dict[str, Any]] = field(default_factory=dict)
    """New upload requests: req_id -> their `kv_transfer_params` (`mpic.engine.vllm.upload`)."""


class MPICConnector(KVConnectorBase_V1):
    """KVConnectorBase_V1 that links MPIC cache entries into a request's paged KV."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        self._extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._pending: dict[str, Request] = {}
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._adapter: VllmLayerAdapter | None = None
        self._store: EntryStore | None = None
        self._capture: vllm_upload.KVCapture | None = None
        self._failed_blocks: set[int] = set()

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Claim prompt tokens [num_computed_tokens, N-1) of a linked request (sync load)."""
        if not vllm_params.is_linked(request.kv_transfer_params):
            return 0, False
        return max(request.num_prompt_tokens - 1 - num_computed_tokens, 0), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Queue a linked request once its blocks exist (new, or resumed after preemption)."""
        if num_external_tokens > 0:
            self._pending[request.request_id] = request

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Ship this step's queued requests with their block ids to the worker."""
        meta = MPICConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params.extra_args if new.sampling_params else None
            params = (params or {}).get("kv_transfer_params")
            if vllm_upload.is_upload(params):
                meta.uploads[new.req_id] = params
            request = self._pending.pop(new.req_id, None)
            if request is not None:
                meta.jobs.append(self._job(request, list(new.block_ids[0])))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            request = self._pending.pop(req_id, None)
            if request is None:
                continue
            if req_id not in cached.resumed_req_ids or cached.new_block_ids[i] is None:
                raise RuntimeError(f"MPIC: request {req_id} queued but not new nor resumed")
            meta.jobs.append(self._job(request, list(cached.new_block_ids[i][0])))
        self._pending.clear()
        return meta

    def _job(self, request: Request, block_ids: list[int]) -> LinkJob:
        return LinkJob(
            req_id=request.request_id,
            token_ids=list(request.prompt_token_ids or []),
            block_ids=block_ids,
            params=dict(request.kv_transfer_params or {}),
        )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Nothing is sent asynchronously: blocks are freed at once."""
        self._pending.pop(request.request_id, None)
        return False, None

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the per-layer paged KV tensors ([num_blocks, H_kv, block_size, 2*D])."""
        self._kv_caches = dict(kv_caches)

    def _model_adapter(self) -> VllmLayerAdapter:
        if self._adapter is None:
            runner = current_runner()
            if runner is None:
                raise RuntimeError(
                    "MPIC connector: no model runner recorded; is the `mpic` vLLM plugin "
                    "installed (entry point vllm.general_plugins)?"
                )
            self._adapter = VllmLayerAdapter(runner.get_model())
        return self._adapter

    def _entry_store(self) -> EntryStore:
        if self._store is None:
            cfg = StorageConfig.model_validate(self._extra.get("storage", {}))
            self._store = EntryStore.from_config(cfg)
        return self._store

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bind the step's metadata; arm upload capture BEFORE the forward (vLLM calls
        `start_load_kv` after the forward when the step has no synchronous load)."""
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, MPICConnectorMetadata)
        if connector_metadata.uploads or self._capture is not None:
            if self._capture is None:
                model = current_runner().get_model()
                self._capture = vllm_upload.KVCapture(model, self._model_adapter())
            context = get_forward_context()
            self._capture.begin_step(
                connector_metadata.uploads, current_runner(), context.attn_metadata
            )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Run the selective prefill of every linked request of this step into its blocks."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, MPICConnectorMetadata)
        for job in meta.jobs:
            began = time.perf_counter()
            try:
                self._link(job)
            except (ObjectNotFoundError, MPICError) as exc:
                # The request fails (kv_load_failure_policy="fail"); the engine wrapper then
                # answers it exactly by plain recomputation (VllmEngine.generate,
                # AsyncVllmEngine.stream).
                logger.warning("MPIC: cannot link %s, failing it: %s", job.req_id, exc)
                self._failed_blocks.update(job.block_ids)
                continue
            logger.debug(
                "MPIC: linked %s (%d tokens) in %.1f ms",
                job.req_id,
                len(job.token_ids),
                1e3 * (time.perf_counter() - began),
            )

    def _link(self, job: LinkJob) -> None:
        """The linker's `link_and_prefill` over the whole prompt, into the request's blocks.

        Token N-1 runs too (its block exists already), so in-pass selections see the same
        tokens as in the reference runner; vLLM's forward then recomputes it identically. The
        plan's depths are the front end's (`mpic.linker.recipe` applied the policy once); the
        policy object only drives two-step passes and in-pass hooks here.
        """
        adapter = self._model_adapter()
        plan, name = vllm_params.plan_from_params(job.params, job.token_ids)
        store = self._entry_store()
        entries = [store.get(entry_id) for entry_id in plan.entry_ids]
        policy = get_policy(name)
        planned = PlannedPrompt(plan, entries, policy, refs=[])
        num_layers = adapter.num_layers
        layers = [adapter.attention_layer(i) for i in range(num_layers)]
        mirror = None
        press = job.params.get(vllm_presses.KEY)  # a compression request (engine/vllm/presses)
        if policy.layer_hook(plan, num_layers) is not None or press is not None:
            # CacheBlend and the presses read linked keys
            shape = (num_layers, plan.num_tokens, adapter.num_kv_heads, adapter.head_dim)
            mirror = torch.zeros(shape, dtype=adapter.dtype)
        caches = [self._kv_caches[layer.layer_name] for layer in layers]
        kv = PagedLinkedKV(layers, caches, job.block_ids, self._block_size, keys=mirror)
        kv.clear()  # the "dummy cache" of zeros, as in the reference runner's dense KV
        if press is None:
            link_and_prefill(adapter, planned, kv)
        else:  # the item's canonical prefill, observed; its compressed entry -> the store
            store.put(press_item_entry(adapter, planned, kv, press["press"], press["budget"]))

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of requests whose entries could not be loaded this step (then cleared)."""
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are synchronous (done in `start_load_kv`)."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing is read back from the paged cache (uploads capture K/V in the forward)."""

    def wait_for_save(self) -> None:
        """After the forward: finish uploads whose prompt has fully run (entry -> store)."""
        if self._capture is not None:
            self._capture.end_step(self._entry_store().put)
