"""The scheduler half of the MPIC KV connector (vLLM engine-core process).

A request whose `kv_transfer_params` carry an MPIC link plan (`mpic.engine.vllm.params`) gets
every prompt token but the last claimed as externally computed (`get_num_new_matched_tokens`),
so vLLM schedules only the last prompt token once the linked KV is in its blocks.

The claim is asynchronous (`load_async=True`, vLLM's `WAITING_FOR_REMOTE_KVS`): vLLM allocates
the request's blocks and parks it; `build_connector_meta` ships a `LinkJob` (its blocks, plan and
entries) to the worker half, which reads the entries in the background and links the request in
the first step after they are in memory, then reports it finished receiving (failed receiving
when an entry cannot be loaded: vLLM fails the request, `kv_load_failure_policy="fail"`, and the
engine wrapper answers it by exact recomputation). Meanwhile every running request keeps
decoding: no step waits on disk or S3.

The claim is synchronous (linked in the step that schedules it, before its forward) for
compression requests and where the last prompt token would have no block under a policy whose
pass reads it (`link_job.needs_last_token`): an async claim of N-1 tokens allocates blocks for
N-1 tokens only. Preempted requests come back through `get_num_new_matched_tokens` and are
linked again into their new blocks (`scheduled_cached_reqs.resumed_req_ids` for sync jobs).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from mpic.engine.vllm import params as vllm_params
from mpic.engine.vllm import presses as vllm_presses
from mpic.engine.vllm import upload as vllm_upload
from mpic.engine.vllm.link_job import (
    LinkJob,
    MPICConnectorMetadata,
    links_in_its_forward_step,
    needs_last_token,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class MPICScheduler:
    """Claims linked requests' tokens and ships their link jobs (see the module docstring).

    block_size: vLLM's KV block size; async_loads: False turns every claim synchronous (entry
    reads inside the step, the former behaviour; `kv_connector_extra_config["async_loads"]`)."""

    def __init__(self, block_size: int, async_loads: bool = True) -> None:
        self.block_size = block_size
        self.async_loads = async_loads
        self._sync: dict[str, Request] = {}
        """Synchronous claims allocated this step, shipped with their scheduled blocks."""
        self._async_new: dict[str, LinkJob] = {}
        """Async claims whose blocks were allocated, not yet shipped."""
        self._loading: set[str] = set()
        """Async jobs shipped to the worker and not yet reported finished receiving."""
        self._async_ids: set[str] = set()
        """Requests whose current claim is asynchronous."""
        self._drop: set[str] = set()
        """Requests that ended while loading (blocks held until the worker drops them)."""

    def _is_async(self, request: Request) -> bool:
        params = request.kv_transfer_params or {}
        if not self.async_loads or vllm_presses.KEY in params:
            return False
        policy = str(params[vllm_params.KEY].get("policy"))
        if links_in_its_forward_step(policy):  # linked-key correction: see link_job
            return False
        last_has_block = (request.num_prompt_tokens - 1) % self.block_size != 0
        return last_has_block or not needs_last_token(policy)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Claim prompt tokens [num_computed_tokens, N-1) of a linked request."""
        if not vllm_params.is_linked(request.kv_transfer_params):
            return 0, False
        claim = max(request.num_prompt_tokens - 1 - num_computed_tokens, 0)
        if claim == 0:
            return 0, False
        load_async = self._is_async(request)
        if load_async:
            self._async_ids.add(request.request_id)
        else:
            self._async_ids.discard(request.request_id)
        return claim, load_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Queue a linked request once its blocks exist (new, or resumed after preemption)."""
        if num_external_tokens <= 0:
            return
        rid = request.request_id
        if rid in self._async_ids:
            job = LinkJob.from_request(
                rid,
                list(request.prompt_token_ids or []),
                list(blocks.get_block_ids()[0]),
                dict(request.kv_transfer_params or {}),
            )
            job.load_async = True
            self._async_new[rid] = job
        else:
            self._sync[rid] = request

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MPICConnectorMetadata:
        """This step's jobs: async claims just allocated, sync claims with their scheduled block
        ids; and the new upload requests."""
        meta = MPICConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params.extra_args if new.sampling_params else None
            params = (params or {}).get("kv_transfer_params")
            if vllm_upload.is_upload(params):
                meta.uploads[new.req_id] = params
            request = self._sync.pop(new.req_id, None)
            if request is not None:
                meta.jobs.append(self._sync_job(request, list(new.block_ids[0])))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            request = self._sync.pop(req_id, None)
            if request is None:
                continue
            if req_id not in cached.resumed_req_ids or cached.new_block_ids[i] is None:
                raise RuntimeError(f"MPIC: request {req_id} queued but not new nor resumed")
            meta.jobs.append(self._sync_job(request, list(cached.new_block_ids[i][0])))
        self._sync.clear()
        meta.jobs.extend(self._async_new.values())
        self._loading.update(self._async_new)
        self._async_new.clear()
        meta.finished, self._drop = self._drop, set()
        return meta

    @staticmethod
    def _sync_job(request: Request, block_ids: list[int]) -> LinkJob:
        return LinkJob.from_request(
            request.request_id,
            list(request.prompt_token_ids or []),
            block_ids,
            dict(request.kv_transfer_params or {}),
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Forget async jobs the worker reported finished (linked or failed). A request that
        ended meanwhile (a failed load finishes it first) has its blocks freed by vLLM on this
        report: it is not shipped to the worker as dropped."""
        for rid in connector_output.finished_recving or ():
            self._loading.discard(rid)
            self._async_ids.discard(rid)
            self._drop.discard(rid)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """A request that ends while its async job is with the worker keeps its blocks until
        the worker has dropped the job (reported as finished sending): the worker must never
        write into blocks vLLM gave to another request."""
        rid = request.request_id
        self._sync.pop(rid, None)
        self._async_ids.discard(rid)
        if self._async_new.pop(rid, None) is not None:
            return False, None  # never shipped: the worker never saw it
        if rid in self._loading:
            self._loading.discard(rid)
            self._drop.add(rid)
            return True, None
        return False, None
