"""What runs the link pass on the vLLM worker (vLLM worker process, the connector's worker half,
`mpic.engine.vllm.connector.worker`, in a step or on its linking thread).

`RequestLinker.link` takes the jobs whose entries are in memory and links them, whatever their
policy (plain, scouting and corrected such as the default `auto`, two-step such as
`full-reuse`, CacheBlend's in-pass check), in ONE link pass together
(`mpic.engine.vllm.connector.batched_link`: the linker's `link_pass`, one text-first pass for
the two-step requests, one scouting pass for the scouting requests, one selective pass for
all, each CacheBlend request checking its own rows), with vLLM's modules (`VllmLayerAdapter`)
into their paged blocks (`PagedLinkedKV`, read straight from the blocks; dense K/V mirrors only
where a CPU layout could not be learnt). A request whose params carry `mpic_press` is an item's
canonical prompt (a compression request): its prefill runs alone, observed, and the item's
compressed entry is written to the store (`mpic.engine.vllm.presses`).

The template/system prefix (`mpic.linker.prefix`, `link_prefix`, on by default): before a
request is linked, the worker finds, from the plan and the entries it has just read, the longest
prompt prefix shared with one entry's canonical context (`prefix_length`, the reference runner's
rule), writes its exact KV (the context's plain prefill over this worker's layer adapter, kept
once per context in a `PrefixCache`; a context never seen is prefilled on first use) into the
request's blocks and gives those tokens depth 0: not recomputed, and a scouting policy spends
their share of the budget on item tokens, as in the reference runner. Where no entry carries a
context (or the prefill fails) the prefix is recomputed as before.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mpic.engine.item_press import press_item_entry
from mpic.engine.vllm.connector.adapter import VllmLayerAdapter
from mpic.engine.vllm.connector.batched_link import BatchItem, link_batch
from mpic.engine.vllm.connector.entry_reads import LOAD_ERRORS
from mpic.engine.vllm.connector.link_job import LinkJob
from mpic.engine.vllm.connector.paged_kv import PagedLinkedKV, paged_ops
from mpic.linker.pipeline import LinkedPrefill
from mpic.linker.policies.base import Policy
from mpic.linker.prefix import CachedPrefix, PrefixCache, takes_prefix
from mpic.linker.recipe import PlannedPrompt
from mpic.storage.entry_store import EntryStore
from mpic.types import CacheEntry, LinkPlan

logger = logging.getLogger(__name__)

Failed = Callable[[LinkJob, BaseException], None]
Linked = Callable[[list[LinkJob], float, Sequence[LinkedPrefill]], None]
Shift = Callable[[LinkJob, PagedLinkedKV, LinkPlan], None]


class RequestLinker:
    """Links jobs into vLLM's paged KV (module docstring).

    block_size: vLLM's KV block size; link_prefix: link the template/system prefix exactly
    (False: recompute it); batch_links: False links every request in a pass of its own (the
    one-after-the-other baseline); adapter, store, caches: this worker's layer adapter, entry
    store and per-layer KV tensors (by vLLM's layer name), made or registered after this;
    stats, lock: the worker's counters and the lock that guards them."""

    def __init__(
        self,
        block_size: int,
        link_prefix: bool,
        batch_links: bool,
        adapter: Callable[[], VllmLayerAdapter],
        store: Callable[[], EntryStore],
        caches: Callable[[], dict[str, torch.Tensor]],
        stats: dict[str, Any],
        lock: threading.Lock,
    ) -> None:
        self.block_size = block_size
        self.link_prefix = link_prefix
        self.batch_links = batch_links
        self._adapter, self._store, self._caches = adapter, store, caches
        self._stats, self._lock = stats, lock
        self._prefixes: PrefixCache | None = None
        self._prefix_lock = threading.Lock()
        """One context prefill at a time (the step and the linking thread may both link)."""

    def link(
        self,
        ready: list[tuple[LinkJob, list[CacheEntry]]],
        adapter: Any,
        failed: Failed,
        linked: Linked,
        shift: Shift,
    ) -> None:
        """Link `ready` with `adapter` (the worker's, or its yielding wrapper on the linking
        thread): a failed job is handed to `failed`, the jobs of each pass, when done, to
        `linked`, each linked request's KV to `shift` (a corrected request's keys shifted for
        vLLM's forward of its last token)."""
        layers = [adapter.attention_layer(i) for i in range(adapter.num_layers)]
        kv_caches = self._caches()
        caches = [kv_caches[layer.layer_name] for layer in layers]
        batch: list[tuple[LinkJob, BatchItem]] = []
        for job, entries in ready:
            began = time.perf_counter()
            try:
                plan = job.plan()
                policy = job.rule()  # parsed once, where the job was built
                prefix = self._prefix(job, policy, plan, entries)
                if job.press is None:  # every policy joins the batch
                    plan = self._fit(job, plan)
                    kv = self._paged_kv(job, policy, plan, layers, caches, adapter)
                    item = BatchItem(plan, entries, kv, job.block_ids, policy, prefix)
                    batch.append((job, item))
                    continue
                self._press(job, plan, entries, layers, caches, adapter)
            except LOAD_ERRORS as exc:
                failed(job, exc)
                continue
            linked([job], began, [])
        groups = [batch] if self.batch_links else [[one] for one in batch]
        for group in groups if batch else []:
            began = time.perf_counter()
            try:
                items = [item for _, item in group]
                outs = link_batch(adapter, items, layers, caches, self.block_size)
                for (job, item), out in zip(group, outs, strict=True):
                    shift(job, item.kv, out.plan)
            except LOAD_ERRORS as exc:
                for job, _ in group:
                    failed(job, exc)
                continue
            linked([job for job, _ in group], began, outs)

    def _prefix(
        self, job: LinkJob, policy: Policy, plan: LinkPlan, entries: list[CacheEntry]
    ) -> CachedPrefix | None:
        """The request's template/system prefix, linked exactly (module docstring), or None:
        `link_prefix` off, a compression request, a policy that takes none (`full`, `prefix`,
        two-step and in-pass-hook policies), no entry context in common, or a failed context
        prefill (logged; the prefix is then recomputed)."""
        if not self.link_prefix or job.press is not None:
            return None
        if not takes_prefix(policy, plan, self._adapter().num_layers):
            return None  # these recompute it (`mpic.linker.pipeline`)
        if self._prefixes is None:
            self._prefixes = PrefixCache(self._adapter())
        cache = self._prefixes
        try:
            with self._prefix_lock, torch.inference_mode():
                prefix = cache.lookup(plan, entries)
        except (RuntimeError, ValueError) as exc:
            logger.warning("MPIC: %s recomputes its prefix: %s", job.req_id, exc)
            return None
        with self._lock:
            self._stats["prefix_contexts"] = cache.prefills
            if prefix is not None:
                self._stats["prefix_linked"] += 1
                self._stats["prefix_tokens"] += prefix.length
        return prefix

    def _fit(self, job: LinkJob, plan: LinkPlan) -> LinkPlan:
        """The plan cut before the last token when that token has no block yet (an async claim
        of N-1 tokens allocates blocks for N-1 only): vLLM's forward computes it."""
        if job.num_tokens <= len(job.block_ids) * self.block_size:
            return plan
        n = job.num_tokens - 1
        return dataclasses.replace(
            plan,
            token_ids=plan.token_ids[:n],
            positions=plan.positions[..., :n],
            source_entry=plan.source_entry[:n],
            source_offset=plan.source_offset[:n],
            recompute_depth=plan.recompute_depth[:n],
        )

    def _press(
        self,
        job: LinkJob,
        plan: LinkPlan,
        entries: list[CacheEntry],
        layers: list,
        caches: list[torch.Tensor],
        adapter: Any,
    ) -> None:
        """A compression request (an item's canonical prompt, `job.press`): its prefill into the
        request's blocks, observed by the press, and the item's compressed entry stored
        (`mpic.engine.item_press`). It links in a pass of its own."""
        assert job.press is not None
        policy = job.rule()
        planned = PlannedPrompt(plan, entries, policy, refs=[])
        kv = self._paged_kv(job, policy, plan, layers, caches, adapter)
        kv.clear()  # the "dummy cache" of zeros, as in the reference runner's dense KV
        entry = press_item_entry(adapter, planned, kv, job.press.press, job.press.budget)
        self._store().put(entry)

    def _paged_kv(
        self,
        job: LinkJob,
        policy: Policy,
        plan: LinkPlan,
        layers: list,
        caches: list[torch.Tensor],
        adapter: Any,
    ) -> PagedLinkedKV:
        """The request's blocks as linked KV. Its pass reads the cache where a policy needs
        linked K/V (CacheBlend's hook and the presses: keys; the linked-key correction: keys and
        values): straight from the blocks where the layout is readable (CUDA, and vLLM's CPU
        cache through its learnt layout, `paged_cpu.cpu_layout`), else from dense mirrors
        [L, N, H_kv, D] kept here (a CPU layout that could not be learnt)."""
        blocks = torch.tensor(job.block_ids, dtype=torch.int64, device=caches[0].device)
        ops = paged_ops(layers, caches, blocks, self.block_size)
        mirror = values = None
        if not ops.readable:
            shape = (adapter.num_layers, plan.num_tokens, adapter.num_kv_heads, adapter.head_dim)
            if policy.layer_hook(plan, adapter.num_layers) is not None or job.press is not None:
                mirror = torch.zeros(shape, dtype=adapter.dtype)
            if policy.corrects:
                mirror = torch.zeros(shape, dtype=adapter.dtype)
                values = torch.zeros(shape, dtype=adapter.dtype)
        return PagedLinkedKV(
            layers, caches, job.block_ids, self.block_size, keys=mirror, ops=ops, values=values
        )
