"""Cache-aware routing of LLM-worker requests (runs inside every process that holds a handle to
the LLMWorker deployment: the Ingress and Resolver replicas; Serve's request-router API).

With several LLM-worker replicas, a chat whose images sit in one replica's memory (or disk) tier
costs a memory read there and an object-store read anywhere else (MPIC section 3.2: load the KV
from the closest tier). `EntryAffinityRouter` scores each replica by how many of the request's
entries it holds:

    score(r) = |{e in entries(request) : e in resident(r)}|

`resident(r)` is what the replica itself reports through Serve's routing-stats hook
(`LLMWorker.record_routing_stats`: the keys of its memory and disk tiers, polled every
`request_routing_stats_period_s`) joined with what this router sent it since (a chat leaves its
entries in the serving replica's memory tier). The replicas with the top score form the first
rank; Serve's base router then picks the shortest queue among them and moves on to the next rank
if all of them are full (`max_ongoing_requests`). The second rank is Serve's power-of-two choice
(two random replicas, the shorter queue wins). The first rank is skipped when no replica holds
any entry, or when the holders' queues are longer than the shortest queue by more than
`max_queue_gap` (an overloaded holder: recomputing nothing but reading from S3 elsewhere is
cheaper than waiting). Requests without entries (uploads, policy checks) go straight to
power-of-two.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from mpic.deployments.messages import LinkedPrompt

ROUTERS = ("cache-aware", "power-of-two")
"""`ServeAppConfig.llm_router` values: this module's router, or Serve's default."""


def request_entry_ids(pending: PendingRequest | None) -> list[str]:
    """Entry ids a request links (the `LinkedPrompt` argument of `LLMWorker.generate`)."""
    if pending is None:
        return []
    for arg in [*pending.args, *pending.kwargs.values()]:
        if isinstance(arg, LinkedPrompt):
            return list(arg.entry_ids)
    return []


def power_of_two(candidates: list[RunningReplica]) -> list[RunningReplica]:
    """Two distinct random replicas (all of them when fewer)."""
    return random.sample(candidates, min(2, len(candidates)))


class EntryAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Route to the replica that holds the request's entries, else power of two choices."""

    def initialize_state(self, max_queue_gap: int = 4, history: int = 65536) -> None:
        """`max_queue_gap`: how many more queued requests a holder may have than the least
        loaded replica before affinity yields to load; `history`: entry->replica assignments
        this router remembers between routing-stats reports."""
        self.max_queue_gap = max_queue_gap
        self._history_size = history
        self._sent: OrderedDict[str, set[ReplicaID]] = OrderedDict()
        self.decisions = {"affinity": 0, "fallback_none": 0, "fallback_load": 0, "no_entries": 0}

    def resident(self, replica: RunningReplica) -> set[str]:
        """Entry ids `replica` reported holding (memory + disk tiers)."""
        stats: dict[str, Any] = replica.routing_stats or {}
        return set(stats.get("memory", ())) | set(stats.get("disk", ()))

    def scores(self, candidates: list[RunningReplica], entries: list[str]) -> dict[ReplicaID, int]:
        """score(r) of the module docstring for every candidate."""
        wanted = set(entries)
        out = {}
        for r in candidates:
            held = self.resident(r) & wanted
            held |= {e for e in wanted if r.replica_id in self._sent.get(e, ())}
            out[r.replica_id] = len(held)
        return out

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Every call offers all the ranks there are: when none of them has room, Serve must
            # sleep (exponential backoff) before the next call. Without this flag its routing
            # loop retries at once, flooding busy or starting replicas with queue-length probes.
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        fallback = power_of_two(candidate_replicas)
        entries = request_entry_ids(pending_request)
        if not entries:
            self.decisions["no_entries"] += 1
            return [fallback]
        scores = self.scores(candidate_replicas, entries)
        best = max(scores.values())
        if best == 0:
            self.decisions["fallback_none"] += 1
            return [fallback]
        holders = [r for r in candidate_replicas if scores[r.replica_id] == best]
        queue = {r.replica_id: self._replica_queue_len_cache.get(r.replica_id) for r in holders}
        known = [q for q in (self._replica_queue_len_cache.get(r.replica_id) for r in
                 candidate_replicas) if q is not None]  # fmt: skip
        shortest = min(known, default=0)
        fit = [r for r in holders if (queue[r.replica_id] or 0) - shortest <= self.max_queue_gap]
        if not fit:
            self.decisions["fallback_load"] += 1
            return [fallback]
        self.decisions["affinity"] += 1
        return [fit, fallback]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result):
        """Remember that `replica_id` now holds the request's entries (its memory tier)."""
        for e in request_entry_ids(pending_request):
            self._sent.setdefault(e, set()).add(replica_id)
            self._sent.move_to_end(e)
        while len(self._sent) > self._history_size:
            self._sent.popitem(last=False)

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None):
        """Give `replica` to the request it was chosen for (the routing task's own request,
        whose metadata object is `request_metadata`). Serve's default matches by internal
        request id, which every call made while serving one HTTP request shares (the `n`
        generate calls of one chat): only the first of them is indexed, so the others were
        never fulfilled and routed forever."""
        for pending in self._pending_requests_to_fulfill:
            if pending.metadata is request_metadata and not pending.future.done():
                self._cancel_routing_task_for_pending_request(pending)
                self._record_queue_wait_time(pending)
                pending.future.set_result(replica)
                if self._pending_requests_by_id.get(request_metadata.internal_request_id) is (
                    pending
                ):
                    self._remove_pending_request_from_indices(pending)
                return
        super()._fulfill_next_pending_request(replica, request_metadata)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        for held in self._sent.values():
            held.discard(replica_id)


def router_options(name: str, stats_period_s: float = 1.0) -> dict[str, Any]:
    """`serve.deployment(...)` keyword arguments selecting router `name` (one of ROUTERS)."""
    if name == "power-of-two":
        return {}
    if name != "cache-aware":
        raise ValueError(f"unknown router {name!r}; expected one of {ROUTERS}")
    return {
        "request_router_config": {
            "request_router_class": EntryAffinityRouter,
            "request_routing_stats_period_s": stats_period_s,
            "request_routing_stats_timeout_s": max(stats_period_s, 1.0),
        }
    }
