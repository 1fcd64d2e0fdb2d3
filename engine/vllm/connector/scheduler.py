"""The scheduler half of the MPIC KV connector (vLLM engine-core process).

A request whose `kv_transfer_params` carry an MPIC link plan (`mpic.engine.vllm.params`) gets
every prompt token but the last claimed as externally computed (`get_num_new_matched_tokens`),
so vLLM schedules only the last prompt token once the linked KV is in its blocks.

The claim is asynchronous (`load_async=True`, vLLM's `WAITING_FOR_REMOTE_KVS`) for every policy:
vLLM allocates the request's blocks and parks it; `build_connector_meta` ships a `LinkJob` (its
blocks, plan and entries) to the worker half, which reads the entries in the background, links
the request in the first step that finds them in memory (load mode `reads`, the default;
`background` links it off the step, on the linking thread) and reports it finished receiving
(failed receiving when an entry cannot be loaded: vLLM fails the request,
`kv_load_failure_policy="fail"`, and the engine wrapper answers it by exact recomputation).
Meanwhile every running request keeps decoding: no step waits on disk or S3 (in load mode
`background`, none waits on linking either).

Two-phase claims (`LinkJob.phase2`): a corrected policy (`scout-*`, the default `auto`) is linked
in the background too, but its keys must be shifted for vLLM's forward of its last prompt token
(`link_job.links_in_its_forward_step`): when vLLM schedules that token, this half names the
request in `MPICConnectorMetadata.shift`. A request whose last token has no block yet under a
policy whose pass reads it (`link_job.needs_last_token`: an async claim of N-1 tokens allocates
blocks for N-1 only), or any non-plain policy in load mode `reads`, has its entries read ahead
and is linked in the step that schedules its last token (shipped again as a synchronous job,
with `has_sync_kv_loads` set so that the worker links it before the forward). The policy name the
request carries is parsed once per claim, by its first job (`LinkJob.from_request`); the second
phase's job reuses that parse.

A claim that starts after a local prefix-cache hit (an identical linked request, same salt, left
its blocks cached) is linked in a step in load mode `background` too (`phase2 = "link"`): the
hit blocks are shared with whoever else holds them, possibly a request decoding now, and a link
rewrites every block of its request (zeroed first); on the linking thread a decoding request's
forward could read them half rewritten, inside a step it never sees them so.

Synchronous claims (linked in the step that schedules them, reads included): compression
requests and load mode `step`. Preempted requests come back through `get_num_new_matched_tokens`
and are linked again into their new blocks (`scheduled_cached_reqs.resumed_req_ids` for sync
jobs).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from mpic.engine.vllm import params as vllm_params
from mpic.engine.vllm import presses as vllm_presses
from mpic.engine.vllm import upload as vllm_upload
from mpic.engine.vllm.connector.link_job import (
    LinkJob,
    MPICConnectorMetadata,
    links_in_its_forward_step,
    load_mode,
    needs_last_token,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from mpic.linker.policies import Policy

logger = logging.getLogger(__name__)


class MPICScheduler:
    """Claims linked requests' tokens and ships their link jobs (see the module docstring).

    block_size: vLLM's KV block size; async_loads: the load mode (`link_job.load_mode`: True
    -> "background", "reads", False -> "step": every claim synchronous)."""

    def __init__(self, block_size: int, async_loads: bool | str = True) -> None:
        self.block_size = block_size
        self.mode = load_mode(async_loads)
        self._sync: dict[str, Request] = {}
        """Synchronous claims allocated this step, shipped with their scheduled blocks."""
        self._async_new: dict[str, LinkJob] = {}
        """Async claims whose blocks were allocated, not yet shipped."""
        self._loading: dict[str, LinkJob] = {}
        """Async jobs shipped to the worker and not yet reported finished receiving."""
        self._async_ids: set[str] = set()
        """Requests whose current claim is asynchronous."""
        self._drop: set[str] = set()
        """Requests that ended while loading (blocks held until the worker drops them)."""
        self._requests: dict[str, Request] = {}
        """Requests with an async two-phase claim (their second phase needs them)."""
        self._phase2: dict[str, tuple[str, Request, Policy | None]] = {}
        """Two-phase requests received, waiting for the step of their last token (with the
        policy their first job parsed: the second reuses it)."""
        self._forget: set[str] = set()
        """Requests that ended between their two phases (the worker drops what it holds)."""
        self._hit: set[str] = set()
        """Async claims that start after a local prefix-cache hit (shared blocks)."""

    def _is_async(self, request: Request) -> bool:
        params = request.kv_transfer_params or {}
        return self.mode != "step" and vllm_presses.KEY not in params

    def _phase2_of(self, request: Request, job: LinkJob) -> str:
        """ "", "link" or "shift" for an async claim (see `LinkJob.phase2`), by the policy
        its job parsed."""
        if self.mode == "background" and request.request_id in self._hit:
            return "link"  # shared prefix-hit blocks: rewritten in a step, never beside one
        policy = job.policy
        if not needs_last_token(policy):  # a plain pass: linked where its entries are
            return ""
        last_has_block = (request.num_prompt_tokens - 1) % self.block_size != 0
        if self.mode == "reads" or not last_has_block:
            return "link"
        return "shift" if links_in_its_forward_step(policy) else ""

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
        rid = request.request_id
        self._phase2.pop(rid, None)  # a new claim (preempted, resumed) starts over
        if load_async:
            self._async_ids.add(rid)
        else:
            self._async_ids.discard(rid)
        if num_computed_tokens > 0:
            self._hit.add(rid)
        else:
            self._hit.discard(rid)
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
            job.phase2 = self._phase2_of(request, job)
            if job.phase2:
                self._requests[rid] = request
            self._async_new[rid] = job
        else:
            self._sync[rid] = request

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MPICConnectorMetadata:
        """This step's jobs: async claims just allocated, sync claims and second phases with
        their scheduled block ids; the second phases' shifts; the new upload requests."""
        meta = MPICConnectorMetadata()
        scheduled: list[tuple[str, list[int]]] = []
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params.extra_args if new.sampling_params else None
            params = (params or {}).get("kv_transfer_params")
            if vllm_upload.is_upload(params):
                meta.uploads[new.req_id] = params
            if new.req_id in self._sync or new.req_id in self._phase2:
                scheduled.append((new.req_id, list(new.block_ids[0])))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in self._sync and req_id not in self._phase2:
                continue
            if req_id not in cached.resumed_req_ids or cached.new_block_ids[i] is None:
                raise RuntimeError(f"MPIC: request {req_id} queued but not new nor resumed")
            scheduled.append((req_id, list(cached.new_block_ids[i][0])))
        for req_id, block_ids in scheduled:
            request = self._sync.pop(req_id, None)
            if request is not None:
                meta.jobs.append(self._sync_job(request, block_ids))
                continue
            kind, request, policy = self._phase2.pop(req_id)
            if kind == "shift":
                meta.shift.add(req_id)
            else:  # linked now, before this step's forward, from the entries read ahead
                meta.jobs.append(self._sync_job(request, block_ids, policy))
                scheduler_output.has_sync_kv_loads = True
        self._sync.clear()
        meta.jobs.extend(self._async_new.values())
        self._loading.update(self._async_new)
        self._async_new.clear()
        meta.finished, self._drop = self._drop, set()
        meta.forget, self._forget = self._forget, set()
        return meta

    @staticmethod
    def _sync_job(request: Request, block_ids: list[int], policy: Policy | None = None) -> LinkJob:
        """A synchronous job; `policy`: the one its first phase parsed (None: parsed now)."""
        return LinkJob.from_request(
            request.request_id,
            list(request.prompt_token_ids or []),
            block_ids,
            dict(request.kv_transfer_params or {}),
            policy,
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Forget async jobs the worker reported finished (linked, read ahead, or failed); a
        two-phase job received waits for the step of its last token. A request that ended
        meanwhile (a failed load finishes it first) has its blocks freed by vLLM on this
        report: it is not shipped to the worker as dropped."""
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        for rid in connector_output.finished_recving or ():
            job = self._loading.pop(rid, None)
            self._async_ids.discard(rid)
            self._drop.discard(rid)
            request = self._requests.pop(rid, None)
            if job is not None and job.phase2 and request is not None and rid not in failed:
                self._phase2[rid] = (job.phase2, request, job.policy)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """A request that ends while its async job is with the worker keeps its blocks until
        the worker has dropped the job (reported as finished sending): the worker must never
        write into blocks vLLM gave to another request."""
        rid = request.request_id
        self._sync.pop(rid, None)
        self._async_ids.discard(rid)
        self._hit.discard(rid)
        self._requests.pop(rid, None)
        if self._phase2.pop(rid, None) is not None:
            self._forget.add(rid)  # received: vLLM frees the blocks, the worker its entries
        if self._async_new.pop(rid, None) is not None:
            return False, None  # never shipped: the worker never saw it
        if self._loading.pop(rid, None) is not None:
            self._drop.add(rid)
            return True, None
        return False, None
