"""One link pass: link and selectively prefill a batch of prompts in one pass over the layers
(linker; the reference runner's `link_and_prefill` is the batch of one, the vLLM worker's
batched pass, `mpic.engine.vllm.connector.batched_link`, the linked requests of a step).

The plans' depths come set from `mpic.linker.recipe`, final for every policy but a scouting one
(`scout-*`, the default `auto`), which is applied again here (its scout's tokens) before its
scout sets the final depths. `link_pass` runs four named stages, each over every request:

1. link (`_link`, per request): the entries' rotated KV (`linked_items`, every item for a
   scout, which then scores those very keys) and the cached prefix (`mpic.linker.prefix`)
   written into the request's linked KV; then ONE text-first pass for all the two-step
   requests (`mpic.linker.two_step`: each one's text alone in view, stacked);
2. scout (`_scout`): ONE scouting pass (`mpic.linker.scout.scout_pass`) for all the scouting
   requests of the batch, their text stacked over the stacked linked KV; each policy then sets
   its request's final depths from its scores (`select`);
3. finish (`_finish`, per request): the cached prefix's tokens at depth 0 (linked exactly; a
   scouting policy spent their share of the budget on item tokens), the policy's linked-key
   correction handed to the request's linked KV, the recomputed tokens' input embeddings;
4. the selective pass (`_selective_pass`): the recomputed tokens of every request, stacked,
   through the layers once (`run_layers`; in-pass hooks, CacheBlend's, each over its own
   request's rows: `_BatchHook`), and each request's last-token logits.

Stacking: request r's prompt index p is the global index `offsets[r] + p` of a linked KV over
all of them (`mpic.linker.kv.stacked.StackedLinkedKV`, or an engine's own subclass such as the
vLLM worker's `BatchedPagedKV`), which sends each row to its request's keys alone. A batch of
one runs over the request's own linked KV (offset 0), with exactly the ops of a pass alone.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mpic.linker.contracts import LayerAdapter
from mpic.linker.kv.linked import LinkedKV
from mpic.linker.kv.stacked import StackedLinkedKV
from mpic.linker.link import LinkedItems, cat_parts, gather_input_embeds, linked_items
from mpic.linker.prefix import CachedPrefix, exclude_prefix
from mpic.linker.recipe import PlannedPrompt
from mpic.linker.scout import ScoutReport, scout_pass
from mpic.linker.selective_prefill import LayerHook, PrefillResult, run_layers
from mpic.linker.two_step import prefill_text_first
from mpic.types import LinkPlan

logger = logging.getLogger(__name__)


@dataclass
class LinkedPrefill:
    """The outcome of `link_pass` for one request (`link_and_prefill`: the batch of one)."""

    plan: LinkPlan
    """The plan with the policy's recompute depths."""
    result: PrefillResult
    recomputed_tokens: int
    """Prompt tokens that ran through at least one layer, over both steps of two-step policies."""
    scout: ScoutReport | None = None
    """The scouting pass's cost (scouting policies only)."""
    cached_prefix: int = 0
    """Leading prompt tokens linked exactly from the prefix cache (`mpic.linker.prefix`):
    depth 0, not recomputed, counted as cached."""


@dataclass(eq=False)
class _Request:
    """One request of a link pass, from stage to stage."""

    planned: PlannedPrompt
    kv: LinkedKV
    offset: int
    """Its first global index in the pass's linked KV."""
    plan: LinkPlan
    """Its depths so far (final after `_scout`, the cached prefix excluded by `_finish`)."""
    ran: torch.Tensor
    """bool [N]: tokens a text-first pass already ran (two-step policies)."""
    hook: LayerHook | None = None
    items: LinkedItems | None = None
    prefix: CachedPrefix | None = None
    scout: ScoutReport | None = None
    index: torch.Tensor | None = None
    """int64 [S] (host): prompt indices of the recomputed tokens, ascending (`_finish`)."""
    embeds: torch.Tensor | None = None
    """[S, hidden]: their input embeddings."""

    @property
    def cached(self) -> int:
        return self.prefix.length if self.prefix is not None else 0

    @property
    def global_index(self) -> torch.Tensor:
        """`index` in the pass's linked KV."""
        assert self.index is not None
        return self.index + self.offset if self.offset else self.index


def link_and_prefill(
    adapter: LayerAdapter, planned: PlannedPrompt, linked_kv: LinkedKV
) -> LinkedPrefill:
    """Fill `linked_kv` for one prompt and return its last token's logits: `link_pass` of one.

    planned: from `mpic.linker.recipe` (the policy's depths are set; a scouting policy's are
    applied again here and replaced by its scout's selection);
    linked_kv: zeroed, at least N slots.
    """
    return link_pass(adapter, [planned], [linked_kv])[0]


def link_pass(
    adapter: LayerAdapter,
    prompts: Sequence[PlannedPrompt],
    kvs: Sequence[LinkedKV],
    stacked: StackedLinkedKV | None = None,
    compute_logits: bool = True,
) -> list[LinkedPrefill]:
    """Link and selectively prefill every prompt of `prompts` in one pass (module docstring).

    kvs: each prompt's linked KV, zeroed, at least N slots; stacked: a linked KV over all of
    them in batch order (default: a `StackedLinkedKV`; none for a batch of one).
    compute_logits: every prompt's last token must be recomputed at every layer, its logits are
    returned (False: the engine computes the last token, vLLM).
    """
    if len(prompts) != len(kvs):
        raise ValueError(f"{len(prompts)} prompts for {len(kvs)} linked KVs")
    if not prompts:
        return []
    pass_kv: LinkedKV
    if stacked is None and len(kvs) == 1:
        pass_kv, offsets = kvs[0], [0]
    else:
        if stacked is None:
            stacked = StackedLinkedKV(kvs, [p.plan.num_tokens for p in prompts])
        pass_kv, offsets = stacked, stacked.offsets[:-1].tolist()
    requests = [
        _link(adapter, p, kv, off) for p, kv, off in zip(prompts, kvs, offsets, strict=True)
    ]
    two_step = [r for r in requests if r.planned.policy.two_step]
    if two_step:  # one text-first pass for all of them, each text alone in view
        prefill_text_first(adapter, [(r.plan, r.kv) for r in two_step])
    _scout(adapter, requests, pass_kv)
    for r in requests:
        _finish(adapter, r)
    results = _selective_pass(adapter, requests, pass_kv, compute_logits)
    return [
        LinkedPrefill(
            plan=r.plan,
            result=result,
            recomputed_tokens=int((r.ran | (result.recompute_depth > 0)).sum()),
            scout=r.scout,
            cached_prefix=r.cached,
        )
        for r, result in zip(requests, results, strict=True)
    ]


class _BatchHook:
    """The in-pass hooks of a batch's requests (`LayerHook`, CacheBlend's KV-deviation check),
    each asked about its own request's active rows, in its own prompt indices and linked KV, as
    in a pass alone (the rows split as the stacked KV splits them for its writes and attention:
    `StackedLinkedKV.by_request`); the other requests' rows stay active. At a layer where no
    hook acts (`acts_at`) nothing is read: no host sync."""

    def __init__(self, requests: list[_Request]) -> None:
        self._hooks = [r.hook for r in requests]  # by batch position
        self._kvs = [r.kv for r in requests]

    def acts_at(self, layer: int) -> bool:
        return any(hook is not None and hook.acts_at(layer) for hook in self._hooks)

    def select(
        self, layer: int, index: torch.Tensor, k: torch.Tensor, linked_kv: LinkedKV
    ) -> torch.Tensor | None:
        """bool [S] over the pass's active rows (global `index`), or None."""
        if not self.acts_at(layer):
            return None
        assert isinstance(linked_kv, StackedLinkedKV), "a batch runs over a stacked KV"
        keep = torch.ones(index.shape[0], dtype=torch.bool)
        for a, b, r, local in linked_kv.by_request(index):  # reads the index: a sync on CUDA
            hook = self._hooks[r]
            if hook is None or not hook.acts_at(layer):
                continue
            chosen = hook.select(layer, local, k[a:b], self._kvs[r])
            if chosen is not None:
                keep[a:b] = chosen.cpu()
        return keep


def _pass_hook(requests: list[_Request]) -> LayerHook | None:
    """The selective pass's in-pass hook: a request's own alone (the very object, as in a pass
    of one), `_BatchHook` over the requests that have one in a batch, None where none has."""
    if len(requests) == 1:
        return requests[0].hook
    return _BatchHook(requests) if any(r.hook is not None for r in requests) else None


def served_plan(planned: PlannedPrompt, num_layers: int, prefix_length: int = 0) -> LinkPlan:
    """The plan `link_pass` serves `planned` with, as far as a process that does not run the
    pass can know it (the vLLM front end, whose worker links): a scouting policy's selection
    made with equal scores, then the first `prefix_length` tokens (the cached prefix) at depth
    0. The scout's scores decide WHICH item tokens are recomputed, not how many (`select`
    fills round(b * N)), so the counts of recomputed and stored tokens are exact; where a
    prompt mixes inline images with stored items, the split of the picks between them is the
    equal-score one (`Prefill.cached_tokens`; the reference runner counts its own picks)."""
    plan = planned.plan
    if planned.policy.scouts:
        equal = torch.zeros(plan.num_tokens, dtype=torch.float32)
        depth = planned.policy.select(plan, planned.entries, equal, num_layers, prefix_length)
        plan = dataclasses.replace(plan, recompute_depth=depth)
    if prefix_length:
        plan = exclude_prefix(plan, prefix_length)
    return plan


def _link(adapter: LayerAdapter, planned: PlannedPrompt, kv: LinkedKV, offset: int) -> _Request:
    """Stage 1: a scouting policy applied again, the entries' rotated KV and the cached prefix
    written into `kv` (a two-step policy's text comes from the batch's text-first pass,
    `link_pass`)."""
    plan, entries, policy = planned.plan, planned.entries, planned.policy
    if policy.scouts:  # a plan carrying an earlier run's final depths scouts from scratch
        plan = policy.apply(plan, entries, adapter.num_layers)
    ran = (
        plan.is_text.clone() if policy.two_step else torch.zeros(plan.num_tokens, dtype=torch.bool)
    )
    hook = policy.layer_hook(plan, adapter.num_layers)
    items = linked_items(
        plan,
        entries,
        adapter.rope,
        adapter.num_layers,
        every_item=hook is not None or policy.scouts,
        device=adapter.device,  # rotate where the model runs (entries may come from storage)
    )
    if items is not None:
        items.write_to(kv)
    prefix = planned.prefix if not policy.two_step and hook is None else None
    if prefix is not None:  # two-step and in-pass-hook policies recompute it
        prefix.write(kv)
    return _Request(planned, kv, offset, plan, ran, hook, items, prefix)


def _scout(adapter: LayerAdapter, requests: list[_Request], pass_kv: LinkedKV) -> None:
    """Stage 2: one scouting pass for every scouting request (over `pass_kv`, which holds them
    all), then each policy's selection from its request's scores (the scout scores the item
    keys just linked: rotated once, for both)."""
    scouting = [r for r in requests if r.planned.policy.scouts]
    if not scouting:
        return
    tasks = [  # the cached prefix is linked exactly already: the scout starts after it
        dataclasses.replace(
            r.planned.policy.scout_task(
                adapter, r.plan, r.planned.entries, r.kv, r.items, r.offset
            ),
            skip=r.cached,
        )
        for r in scouting
    ]
    scored = scout_pass(adapter, tasks, pass_kv)
    for r, (scores, report) in zip(scouting, scored, strict=True):
        set_correction = getattr(r.kv, "set_correction", None)
        if set_correction is not None:  # the scout's own correction (if any) ends with it
            set_correction(None)
        depth = r.planned.policy.select(
            r.plan, r.planned.entries, scores, adapter.num_layers, r.cached
        )
        r.plan = dataclasses.replace(r.plan, recompute_depth=depth)
        r.scout = report


def _finish(adapter: LayerAdapter, r: _Request) -> None:
    """Stage 3: the cached prefix excluded, the correction set, the inputs gathered."""
    policy = r.planned.policy
    if r.prefix is not None:
        r.plan = r.prefix.exclude(r.plan)  # linked exactly from the prefix cache
    correction = policy.correction(r.plan, adapter.num_layers, r.planned.entries)
    if correction is not None:
        set_correction = getattr(r.kv, "set_correction", None)
        if set_correction is None:
            logger.warning("%s: this linked KV has no correction; plain attention", policy.name)
        else:
            set_correction(correction)
    r.index = torch.nonzero(r.plan.recompute_depth > 0).flatten()
    r.embeds = gather_input_embeds(adapter, r.plan, r.planned.entries, r.index)


def _selective_pass(
    adapter: LayerAdapter, requests: list[_Request], pass_kv: LinkedKV, compute_logits: bool
) -> list[PrefillResult]:
    """Stage 4: every request's recomputed tokens through the layers in one `run_layers`, and
    the depth each token actually ran to (and the last tokens' logits)."""
    running = [i for i, r in enumerate(requests) if r.index is not None and r.index.numel()]
    depth = [r.plan.recompute_depth.clone() for r in requests]
    logits: list[torch.Tensor | None] = [None] * len(requests)
    if not running:
        assert not compute_logits, "last token not recomputed"
    else:
        index = cat_parts([requests[i].global_index for i in running])
        lasts = [r.offset + r.plan.num_tokens - 1 for r in requests]
        # only the last tokens' hidden states are read (logits), or none (vLLM computes them)
        read = torch.tensor(lasts if compute_logits else [], dtype=torch.int64)
        hidden, final, run_depth = run_layers(
            adapter,
            pass_kv,
            cat_parts([requests[i].embeds for i in running]),
            index,
            cat_parts(
                [requests[i].plan.positions[..., requests[i].index] for i in running], dim=-1
            ),
            cat_parts([requests[i].plan.recompute_depth[requests[i].index] for i in running]),
            _pass_hook(requests),
            outputs=torch.isin(index.cpu(), read),
        )
        start = 0
        for i in running:
            end = start + int(requests[i].index.numel())
            depth[i][requests[i].index] = run_depth[start:end]
            start = end
        if compute_logits:
            row_of = {int(g): row for row, g in enumerate(final.tolist())}
            assert all(last in row_of for last in lasts), "last token not recomputed"
            rows = torch.tensor([row_of[last] for last in lasts], device=hidden.device)
            out = adapter.logits(hidden[rows])
            logits = [out[i].float() for i in range(len(requests))]
    return [
        PrefillResult(logits=lg, recompute_depth=d) for lg, d in zip(logits, depth, strict=True)
    ]
