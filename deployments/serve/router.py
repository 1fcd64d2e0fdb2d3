"""Cache-aware routing of LLM-worker requests bounded by load (runs inside every process that
holds a handle to the LLMWorker deployment: the Ingress and Resolver replicas; Serve's
request-router API).

With several LLM-worker replicas, a chat whose entries sit in one replica's memory (or disk) tier
costs a memory read there and an object-store read anywhere else (MPIC section 3.2: load the KV
from the closest tier); but sending every chat of a user to one replica piles them in its queue.
`EntryAffinityRouter` weighs both: cache affinity bounded by load, as Ray Serve's
`PrefixCacheAffinityRouter` (`imbalanced_threshold`), with misses costed by where each entry lives.
For a request linking entries E, at each candidate replica r:

    cost(r) = miss_s(r) + service_s * max(0, q(r) - min_r' q(r') - imbalance_threshold)
    miss_s(r) = max_{e in E} load_s(tier_r(e)) + |{e in E: tier_r(e) != memory}| * evict_s(r)

- q(r): requests queued or running at r (Serve's queue-length cache; replicas without a cached
  length are probed, as Ray Serve's prefix-aware router does). Queue differences up to
  `imbalance_threshold` count as ties (affinity decides); each request past it costs `service_s`,
  how long one request holds a replica, learned by this router (time from routing to completion
  over the requests that were ahead of it: `on_request_routed`, `on_request_completed`).
- tier_r(e): memory if r reported `e` in its memory tier or this router sent r a request linking
  `e` after that report was taken (a chat leaves its entries there; reports carry their wall
  time `at`, and a request sent up to `SENT_GRACE_S` before it may not have loaded yet), disk if
  r reported it in its disk tier, else the object store (`remote`). An older send counts for
  nothing: the report says whether the entry is still there or was evicted since.
  load_s(tier): the mean entry load time r measured per tier
  (`LLMWorker.record_routing_stats`: the store's `mpic_store_load_seconds`), with defaults until
  it has measured one. Entries load in parallel (`fetch_entries`), hence the max.
- evict_s(r): what a miss costs later. A missed entry is admitted into r's memory tier; when that
  tier is full (`memory_full` in r's routing stats; assumed until r reports) it pushes out
  another entry, which a later chat reads back from the object store: load_s(remote) at r.
  Without this charge a replica holding one of two entries and one holding none would tie
  (parallel loads cost the same), and duplicates would crowd both tiers.

So with a fast store a chat follows its entries while the queues stay within the threshold and
goes to the least loaded replica past it; a slow object store makes affinity worth more queueing
(past the threshold too, while a miss costs more than the extra wait). Replicas rank by cost;
equal costs form one rank (Serve picks the shorter queue within a rank, then the next rank when a
rank is full). Requests without entries (uploads, policy checks) go to Serve's power of two
choices. `decisions` counts each outcome: `affinity` (the entries decided), `load` (the shorter
queue did: entries held alike), `imbalanced` (a replica holding more of the entries lost on its
queue), `no_entries`.
"""

from __future__ import annotations

import random
import time
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


SENT_GRACE_S = 1.0
"""A request routed this long before a routing-stats report may not have loaded its entries when
the report was taken: its entries count as in memory at its replica until a later report."""

DEFAULT_LOAD_S = {"memory": 0.0005, "disk": 0.005, "remote": 0.05}
"""Entry load seconds per tier until a replica reports its own measurements."""


class EntryAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Route to the replica with the least cost (see the module docstring): entry loads by where
    each entry lives plus the evictions a miss causes, with queue differences up to
    `imbalance_threshold` counted as ties and each request past it as `service_s` of wait."""

    def initialize_state(
        self,
        imbalance_threshold: int = 2,
        service_s: float = 0.25,
        history: int = 65536,
        max_queue_gap: int | None = None,
    ) -> None:
        """`imbalance_threshold`: queue-length difference counted as a tie (past it, each
        queued request costs `service_s`);
        `service_s`: a request's service time until this router has measured one; `history`:
        entry->replica assignments remembered between routing-stats reports. `max_queue_gap`:
        the former name of `imbalance_threshold`."""
        if max_queue_gap is not None:
            imbalance_threshold = max_queue_gap
        self.imbalance_threshold = imbalance_threshold
        self.service_s = service_s
        self._service_seen = 0
        self._history_size = history
        self._sent: OrderedDict[str, dict[ReplicaID, float]] = OrderedDict()  # wall time
        self._started: dict[tuple[ReplicaID, str], tuple[float, int]] = {}
        self.decisions = {"affinity": 0, "load": 0, "imbalanced": 0, "no_entries": 0}

    # ------------------------------------------------------------------ what replicas hold
    def resident(self, replica: RunningReplica) -> set[str]:
        """Entry ids `replica` reported holding (memory + disk tiers)."""
        stats: dict[str, Any] = replica.routing_stats or {}
        return set(stats.get("memory", ())) | set(stats.get("disk", ()))

    def tiers(self, replica: RunningReplica, entries: list[str]) -> list[str]:
        """Where each of `entries` lives as seen from `replica`: memory, disk or remote."""
        stats: dict[str, Any] = replica.routing_stats or {}
        memory, disk = set(stats.get("memory", ())), set(stats.get("disk", ()))
        out = []
        reported_at = float(stats.get("at", 0.0))
        for e in entries:
            sent_at = self._sent.get(e, {}).get(replica.replica_id)
            if e in memory or (sent_at is not None and sent_at > reported_at - SENT_GRACE_S):
                out.append("memory")
            elif e in disk:
                out.append("disk")
            else:
                out.append("remote")
        return out

    def scores(self, candidates: list[RunningReplica], entries: list[str]) -> dict[ReplicaID, int]:
        """How many of `entries` each candidate holds in a local tier (memory or disk)."""
        return {
            r.replica_id: sum(t != "remote" for t in self.tiers(r, list(dict.fromkeys(entries))))
            for r in candidates
        }

    def tier_load_s(self, replica: RunningReplica) -> dict[str, float]:
        """Mean seconds `replica` takes to load one entry from each tier (its measurements, else
        `DEFAULT_LOAD_S`)."""
        measured = (replica.routing_stats or {}).get("load_s", {})
        return {t: float(measured.get(t) or DEFAULT_LOAD_S[t]) for t in DEFAULT_LOAD_S}

    def miss_s(self, replica: RunningReplica, entries: list[str]) -> float:
        """miss_s(r) of the module docstring: seconds `replica` would spend loading `entries`
        (each once, in parallel) from where they live, plus evict_s(r) per entry it does not
        hold in memory (the entry its admission pushes out, read back later)."""
        tiers = self.tiers(replica, list(dict.fromkeys(entries)))
        if not tiers:
            return 0.0
        per_tier = self.tier_load_s(replica)
        full = (replica.routing_stats or {}).get("memory_full", True)
        evict_s = per_tier["remote"] if full else 0.0
        return max(per_tier[t] for t in tiers) + sum(t != "memory" for t in tiers) * evict_s

    # ------------------------------------------------------------------ load
    async def queue_lengths(self, candidates: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Requests at each candidate: Serve's cache, probing replicas it has no value for."""
        out: dict[ReplicaID, int] = {}
        missing = []
        for r in candidates:
            q = self._replica_queue_len_cache.get(r.replica_id)
            if q is None:
                missing.append(r)
            else:
                out[r.replica_id] = q
        if missing:
            try:
                probed = await self._probe_queue_lens(missing, 0)
            except Exception:  # noqa: BLE001 - a probe failure must not fail the request
                probed = []
            for r, q in probed:
                if q is not None:
                    out[r.replica_id] = q
        for r in candidates:
            out.setdefault(r.replica_id, 0)
        return out

    def cost(self, replica: RunningReplica, excess: int, entries: list[str]) -> float:
        """cost(r) of the module docstring, in seconds; `excess`: q(r) minus the shortest
        queue among the candidates."""
        wait = max(0, excess - self.imbalance_threshold) * self.service_s
        return wait + self.miss_s(replica, entries)

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
        entries = request_entry_ids(pending_request)
        if not entries:
            self.decisions["no_entries"] += 1
            return [power_of_two(candidate_replicas)]
        queue = await self.queue_lengths(candidate_replicas)
        shortest = min(queue.values())
        costs = {
            r.replica_id: self.cost(r, queue[r.replica_id] - shortest, entries)
            for r in candidate_replicas
        }
        ranked = sorted(candidate_replicas, key=lambda r: costs[r.replica_id])
        ranks: list[list[RunningReplica]] = []
        for r in ranked:
            if ranks and abs(costs[ranks[-1][0].replica_id] - costs[r.replica_id]) < 1e-9:
                ranks[-1].append(r)
            else:
                ranks.append([r])
        held = self.scores(candidate_replicas, entries)
        best = min(ranks[0], key=lambda r: queue[r.replica_id])  # Serve's pick within the rank
        if held[best.replica_id] < max(held.values()):
            self.decisions["imbalanced"] += 1  # a replica holding more lost on its queue
        elif held[best.replica_id] > min(held.values()):
            self.decisions["affinity"] += 1
        else:
            self.decisions["load"] += 1
        return ranks

    # ------------------------------------------------------------------ learning
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result):
        """Remember that `replica_id` now holds the request's entries (its memory tier), and
        when it was sent there with how many requests ahead of it."""
        for e in request_entry_ids(pending_request):
            self._sent.setdefault(e, {})[replica_id] = time.time()
            self._sent.move_to_end(e)
        while len(self._sent) > self._history_size:
            self._sent.popitem(last=False)
        if pending_request is not None:
            ahead = self._replica_queue_len_cache.get(replica_id) or 0
            key = (replica_id, pending_request.metadata.internal_request_id)
            self._started.setdefault(key, (time.monotonic(), max(int(ahead) - 1, 0)))
            if len(self._started) > 4096:  # completions that never came (a dead replica)
                self._started.pop(next(iter(self._started)))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Learn `service_s`: the request's time at the replica over the requests it waited
        behind plus itself (an exponential average)."""
        began = self._started.pop((replica_id, internal_request_id), None)
        if began is None:
            return
        t0, ahead = began
        sample = (time.monotonic() - t0) / (ahead + 1)
        weight = 0.2 if self._service_seen >= 5 else 1.0 / (self._service_seen + 1)
        self.service_s += weight * (sample - self.service_s)
        self._service_seen += 1

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
            held.pop(replica_id, None)


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
