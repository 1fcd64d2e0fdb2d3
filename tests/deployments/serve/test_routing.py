"""`EntryAffinityRouter` (mpic.deployments.serve.router), driven through Serve's router interface
with stand-in replicas (fast): replicas rank by cost (entry loads by tier, plus the eviction a
miss causes in a full memory tier), ties together; memory beats disk beats the object store;
queue differences within the imbalance threshold are ties and each request past it costs a
service time, so a fast store sends the chat to the least loaded replica there and a slow one
keeps it with its entries; the service time is learned from completions; routed requests are
remembered until the replicas report; uploads (no entries) go to power of two; and the
`llm_router` config puts the router class into the LLMWorker deployment options."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from mpic.deployments.config import ServeAppConfig
from mpic.deployments.messages import LinkedPrompt, LinkedTurn, Segment
from mpic.deployments.serve.router import EntryAffinityRouter, request_entry_ids, router_options

DEP = DeploymentID(name="LLMWorker", app_name="t")


@dataclass
class FakeReplica:
    """The RunningReplica attributes the router reads."""

    name: str
    routing_stats: dict = field(default_factory=dict)
    max_ongoing_requests: int = 4

    def __post_init__(self) -> None:
        self.replica_id = ReplicaID(unique_id=self.name, deployment_id=DEP)


def prompt(*entries: str) -> PendingRequest:
    segs = [Segment("text", text="look")] + [Segment("entry", entry_id=e) for e in entries]
    linked = LinkedPrompt([LinkedTurn("user", segs)], policy="mpic-32", max_tokens=1)
    meta = RequestMetadata(request_id="r", internal_request_id="i", call_method="generate")
    return PendingRequest(args=[linked], kwargs={}, metadata=meta, future=None)


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture
def router(loop) -> EntryAffinityRouter:
    async def make() -> EntryAffinityRouter:
        r = EntryAffinityRouter(
            deployment_id=DEP,
            handle_source=DeploymentHandleSource.UNKNOWN,
            use_replica_queue_len_cache=True,
        )
        r.initialize_state(imbalance_threshold=2)
        return r

    r = loop.run_until_complete(make())
    r.test_loop = loop
    return r


def choose(router, replicas, pending) -> list[list[str]]:
    ranks = router.test_loop.run_until_complete(router.choose_replicas(replicas, pending))
    return [[r.name for r in rank] for rank in ranks]


def test_cheapest_replica_ranks_first_by_where_entries_live(router) -> None:
    # default load times: memory 0.0005 s, disk 0.005 s, remote 0.05 s; memory tiers full
    # (assumed until reported): each entry not in memory also costs the 0.05 s re-read of the
    # entry its admission evicts
    a = FakeReplica("a", {"memory": ["e1"], "disk": []})
    b = FakeReplica("b", {"memory": ["e2", "e3"], "disk": ["e4"]})
    c = FakeReplica("c", {})
    assert router.miss_s(b, ["e2", "e4", "e9"]) == pytest.approx(0.05 + 2 * 0.05)
    assert router.miss_s(a, ["e2", "e4", "e9"]) == pytest.approx(0.05 + 3 * 0.05)
    ranks = choose(router, [a, b, c], prompt("e2", "e4", "e9"))
    assert ranks[0] == ["b"] and sorted(ranks[1]) == ["a", "c"]
    ranks = choose(router, [a, b, c], prompt("e1", "e3"))
    assert sorted(ranks[0]) == ["a", "b"] and ranks[1] == ["c"]  # a tie: the shorter queue wins
    assert router.decisions["affinity"] == 2
    # a disk hit beats a remote read; a memory hit beats a disk hit
    d = FakeReplica("d", {"disk": ["e5"]})
    assert router.miss_s(d, ["e5"]) == pytest.approx(0.005 + 0.05)
    assert choose(router, [c, d], prompt("e5"))[0] == ["d"]
    e = FakeReplica("e", {"memory": ["e5"]})
    assert router.miss_s(e, ["e5"]) == pytest.approx(0.0005)
    assert choose(router, [d, e], prompt("e5"))[0] == ["e"]


def test_a_miss_is_charged_for_the_eviction_it_causes(router) -> None:
    # parallel loads: holding one of two entries saves no load time, only the eviction
    a = FakeReplica("a", {"memory": ["e1"], "memory_full": True})
    b = FakeReplica("b", {"memory": [], "memory_full": True})
    assert choose(router, [a, b], prompt("e1", "e2"))[0] == ["a"]  # 0.05 + 0.05 < 0.05 + 0.1
    b.routing_stats["memory_full"] = False  # room at b: its two misses evict nothing
    assert router.miss_s(b, ["e1", "e2"]) == pytest.approx(0.05)
    assert choose(router, [a, b], prompt("e1", "e2"))[0] == ["b"]
    assert router.decisions == {"affinity": 1, "load": 0, "imbalanced": 1, "no_entries": 0}


def test_no_holder_or_no_entries(router) -> None:
    a, b, c = FakeReplica("a", {"memory": ["e1"]}), FakeReplica("b"), FakeReplica("c")
    (rank,) = choose(router, [a, b, c], prompt("zz"))  # nobody holds it: one rank, by queue
    assert sorted(rank) == ["a", "b", "c"]
    meta = RequestMetadata(request_id="u", internal_request_id="u", call_method="upload")
    (rank,) = choose(
        router, [a, b, c], PendingRequest(args=["alice"], kwargs={}, metadata=meta, future=None)
    )
    assert len(rank) == 2  # power of two
    assert router.decisions == {"affinity": 0, "load": 1, "imbalanced": 0, "no_entries": 1}


def test_queue_differences_within_the_threshold_are_ties(router) -> None:
    a, b = FakeReplica("a", {"memory": ["e1"]}), FakeReplica("b")
    router._replica_queue_len_cache.update(a.replica_id, 2)
    router._replica_queue_len_cache.update(b.replica_id, 0)
    # 2 more requests at a: within the threshold (2), so the entries decide
    assert router.cost(a, 2, ["e1"]) == pytest.approx(0.0005)
    assert choose(router, [a, b], prompt("e1")) == [["a"], ["b"]]
    assert router.decisions["affinity"] == 1
    # one past it costs a service time (0.25 s) > a miss and its eviction at b (0.1 s)
    router._replica_queue_len_cache.update(a.replica_id, 3)
    assert router.cost(a, 3, ["e1"]) == pytest.approx(0.25 + 0.0005)
    assert choose(router, [a, b], prompt("e1")) == [["b"], ["a"]]
    assert router.decisions["imbalanced"] == 1
    # nobody holds the entry (queues within the threshold): one rank, Serve takes the shorter
    router._replica_queue_len_cache.update(a.replica_id, 2)
    assert sorted(choose(router, [a, b], prompt("e9"))[0]) == ["a", "b"]


def test_a_slow_store_makes_affinity_worth_queueing_past_the_threshold(router) -> None:
    a = FakeReplica("a", {"memory": ["e1"]})
    b = FakeReplica("b", {"load_s": {"remote": 0.3}})  # b measured 0.3 s per object read
    router._replica_queue_len_cache.update(b.replica_id, 0)
    router._replica_queue_len_cache.update(a.replica_id, 4)  # 2 past: 0.5 s < 0.3 + 0.3 s
    assert choose(router, [a, b], prompt("e1"))[0] == ["a"]
    router._replica_queue_len_cache.update(a.replica_id, 5)  # 3 past: 0.75 s > 0.6 s
    assert choose(router, [a, b], prompt("e1"))[0] == ["b"]
    assert router.decisions == {"affinity": 1, "load": 0, "imbalanced": 1, "no_entries": 0}


def test_service_time_is_learned_from_completions(router) -> None:
    a = FakeReplica("a")
    router._replica_queue_len_cache.update(a.replica_id, 2)  # this request and 1 ahead
    pending = prompt("e1")
    router.on_request_routed(pending, a.replica_id, None)
    key = (a.replica_id, pending.metadata.internal_request_id)
    t0, ahead = router._started[key]
    router._started[key] = (t0 - 1.0, ahead)  # it took 1 s behind 1 request: 0.5 s each
    router.on_request_completed(a.replica_id, pending.metadata.internal_request_id)
    assert ahead == 1 and router.service_s == pytest.approx(0.5, abs=0.05)


def test_routed_requests_are_remembered_until_reported(router) -> None:
    a, b = FakeReplica("a"), FakeReplica("b")
    pending = prompt("new")
    router.on_request_routed(pending, b.replica_id, None)
    assert choose(router, [a, b], prompt("new"))[0] == ["b"]
    sent_at = router._sent["new"][b.replica_id]
    b.routing_stats = {"at": sent_at + 0.5, "memory": []}  # may predate the load: still held
    assert router.tiers(b, ["new"]) == ["memory"]
    b.routing_stats = {"at": sent_at + 1.5, "memory": []}  # a later report: evicted since
    assert router.tiers(b, ["new"]) == ["remote"]
    b.routing_stats = {"at": sent_at + 1.5, "memory": ["new"]}
    assert router.tiers(b, ["new"]) == ["memory"]
    b.routing_stats = {}
    router.on_replica_actor_died(b.replica_id)
    assert router.scores([a, b], ["new"]) == {a.replica_id: 0, b.replica_id: 0}
    assert request_entry_ids(prompt("x", "y", "x")) == ["x", "y", "x"]


def test_every_choice_asks_serve_to_back_off(router) -> None:
    # without the flag Serve's routing loop re-probes at once when no rank has room (a probe
    # storm that starved a starting replica: an n=2 chat hung for 10 minutes)
    a, b = FakeReplica("a", {"memory": ["e1"]}), FakeReplica("b")
    for pending in (prompt("e1"), prompt("e9"), prompt()):
        assert not pending.routing_context.should_backoff
        choose(router, [a, b], pending)
        assert pending.routing_context.should_backoff


def test_calls_sharing_a_request_id_each_get_their_replica(router) -> None:
    # the n generate calls of one chat share Serve's internal request id: each routing task
    # must fulfil its own call (Serve's default fulfilled the first one only)
    a, b = FakeReplica("a"), FakeReplica("b")
    loop = router.test_loop

    async def run() -> tuple:
        first, second = prompt("e1"), prompt("e1")
        for pending in (first, second):
            pending.reset_future()
            router._pending_requests_to_fulfill.append(pending)
            router._add_pending_request_to_indices(pending)
        router._fulfill_next_pending_request(b, second.metadata)
        assert second.future.done() and not first.future.done()
        router._fulfill_next_pending_request(a, first.metadata)
        return await first.future, await second.future

    assert loop.run_until_complete(run()) == (a, b)


def test_routing_stats_say_when_a_miss_would_evict() -> None:
    from types import SimpleNamespace

    from mpic.deployments.serve.workers import LLMWorker
    from mpic.storage.metrics import StoreMetrics
    from mpic.storage.tiers.memory import MemoryTier, entry_nbytes
    from tests.storage.synthetic import make_entry

    entries = [make_entry(i) for i in range(3)]
    size = entry_nbytes(entries[0])
    memory = MemoryTier(int(2.5 * size))  # room for 2 entries and a half
    worker = SimpleNamespace(
        entries=SimpleNamespace(memory=memory, disk=None, metrics=StoreMetrics())
    )
    stats = LLMWorker.record_routing_stats(worker)
    assert stats["memory"] == [] and stats["memory_full"] is False
    memory.put(entries[0].entry_id, entries[0])
    assert LLMWorker.record_routing_stats(worker)["memory_full"] is False  # 1.5 entries free
    memory.put(entries[1].entry_id, entries[1])
    stats = LLMWorker.record_routing_stats(worker)  # half an entry free: the next one evicts
    assert stats["memory_full"] is True
    assert stats["memory"] == [entries[0].entry_id, entries[1].entry_id]
    assert stats["disk"] == [] and stats["load_s"] == {}
    assert abs(stats["at"] - time.time()) < 60


def test_config_selects_the_router() -> None:
    from mpic.deployments.app import build_app

    opts = router_options("cache-aware", stats_period_s=0.5)
    cfg = opts["request_router_config"]
    assert cfg["request_router_class"] is EntryAffinityRouter
    assert cfg["request_routing_stats_period_s"] == 0.5
    assert router_options("power-of-two") == {}
    with pytest.raises(ValueError):
        router_options("random")
    for name, cls in [("cache-aware", EntryAffinityRouter), ("power-of-two", None)]:
        app = build_app(ServeAppConfig(llm_router=name))
        workers = _find(app, "LLMWorker")
        rc = workers._deployment_config.request_router_config
        if cls is None:
            assert "PowerOfTwo" in str(rc.request_router_class)
        else:
            assert rc.get_request_router_class() is cls


def _find(app, name: str):
    stack = [app]
    while stack:
        dep = stack.pop()._bound_deployment
        if dep.name == name:
            return dep
        rc = dep._replica_config
        stack.extend(
            a for a in [*rc.init_args, *rc.init_kwargs.values()] if hasattr(a, "_bound_deployment")
        )
    raise KeyError(name)


# --- autoscaling with the cache-aware router (slow; its own Ray instance) ---------------------


@pytest.mark.slow
def test_llm_workers_scale_up_under_load_and_down_when_idle(tiny_llava_dir, tmp_path) -> None:
    """1 -> 2 LLM-worker replicas under 6 concurrent clients, back to 1 when idle, and the files
    uploaded before still answer the same afterwards (entries from the survivor's memory tier or
    from the store). Runs this module as a script so its Ray instance stays its own."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    out = tmp_path / "autoscale.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.deployments.serve.test_routing",
            str(tiny_llava_dir),
            str(out),
        ],
        cwd=root,
        env={  # no configured keys: its dev-mode app keeps the dev keys (closed otherwise)
            **{
                k: v for k, v in os.environ.items() if k not in ("MPIC_API_KEYS", "MPIC_ADMIN_KEYS")
            },
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(root),
        },
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    facts = json.loads(out.read_text())
    counts = [n for _, n in facts["timeline"]]
    changes = [(t, n) for i, (t, n) in enumerate(facts["timeline"]) if i == 0 or n != counts[i - 1]]
    print(json.dumps({k: v for k, v in facts.items() if k != "timeline"}, indent=1))
    print("running LLMWorker replicas (s since start, count) at each change:", changes)
    assert counts[0] == 1 and max(counts) == 2 and counts[-1] == 1
    assert facts["up_after_s"] > 0 and facts["down_after_s"] > 0
    assert facts["after"]["answer"] == facts["before"]["answer"]
    assert sum(facts["after"]["tier_hits"].values()) == 2 and facts["after"]["fallbacks"] == 0


def _autoscale_run(model_dir: str, out: str) -> None:
    import json
    import tempfile
    import threading
    import time
    from pathlib import Path

    import httpx
    from ray import serve

    from mpic.deployments.config import AuthConfig
    from mpic.deployments.local import start_local, stop_local
    from tests.deployments.conftest import png, serve_config
    from tests.fixtures.s3 import free_port

    # The session app's config (LLM worker 1..2 replicas at target_ongoing_requests=1), with dev
    # keys, the cache-aware router and a 5 s downscale delay.
    cfg = serve_config(Path(model_dir), Path(tempfile.mkdtemp()))
    worker = cfg.llm_worker.model_copy(deep=True)
    worker.autoscaling.downscale_delay_s = 5
    cfg = cfg.model_copy(
        update={"auth": AuthConfig(mode="dev"), "llm_worker": worker, "llm_router": "cache-aware"}
    )
    url = start_local(cfg, port=free_port(), num_cpus=2, log_to_driver=False)
    facts: dict = {"timeline": []}
    t0 = time.monotonic()

    def replicas() -> int:
        dep = serve.status().applications[cfg.name].deployments["LLMWorker"]
        n = dep.replica_states.get("RUNNING", 0)
        facts["timeline"].append((round(time.monotonic() - t0, 1), n))
        return n

    try:
        http = httpx.Client(
            base_url=url, headers={"Authorization": "Bearer mpic-dev-alice"}, timeout=300
        )
        ids = [
            http.post(
                "/v1/files",
                files={"file": (f"{i}.png", png(300 + i), "image/png")},
                data={"purpose": "vision"},
            ).json()["id"]
            for i in range(2)
        ]

        def ask() -> dict:
            content = [{"type": "text", "text": "Compare"}] + [
                {"type": "file", "file": {"file_id": i}} for i in ids
            ]
            body = {"model": "mpic", "max_tokens": 4, "mpic": {"policy": "mpic-4"}}
            r = http.post(
                "/v1/chat/completions",
                json=body | {"messages": [{"role": "user", "content": content}]},
            )
            r.raise_for_status()
            j = r.json()
            return {"answer": j["choices"][0]["message"]["content"]} | {
                k: j["mpic"][k] for k in ("tier_hits", "fallbacks")
            }

        facts["before"] = ask()
        replicas()
        stop = threading.Event()

        def client() -> None:
            while not stop.is_set():
                ask()

        threads = [threading.Thread(target=client, daemon=True) for _ in range(6)]
        for t in threads:
            t.start()
        start = time.monotonic()
        while time.monotonic() - start < 150 and replicas() < 2:
            time.sleep(1)
        facts["up_after_s"] = round(time.monotonic() - start, 1)
        time.sleep(3)
        replicas()
        stop.set()
        for t in threads:
            t.join(timeout=120)
        start = time.monotonic()
        while time.monotonic() - start < 150 and replicas() > 1:
            time.sleep(1)
        facts["down_after_s"] = round(time.monotonic() - start, 1)
        time.sleep(2)
        replicas()
        facts["after"] = ask()
    finally:
        Path(out).write_text(json.dumps(facts, indent=1))
        stop_local()


if __name__ == "__main__":
    import sys

    _autoscale_run(sys.argv[1], sys.argv[2])
