"""The MPIC connector's scheduler half and the batched pass's request routing, without an engine
(fast): which claims are asynchronous, what each step ships, the drop protocol of requests that
end while their entries load, how a batch splits queries into per-request runs, and a batch of
scouting requests linked by `link_batch` (one scouting pass) equal to each linked alone."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from mpic.engine.vllm import params as vllm_params
from mpic.engine.vllm import presses as vllm_presses
from mpic.engine.vllm.connector.batched_link import BatchedPagedKV, BatchItem, link_batch
from mpic.engine.vllm.connector.link_job import LinkJob, batchable, needs_last_token
from mpic.engine.vllm.connector.paged_cuda import FlashPagedOps
from mpic.engine.vllm.connector.paged_kv import PagedLinkedKV
from mpic.engine.vllm.connector.scheduler import MPICScheduler
from mpic.linker.kv.dense import DenseLinkedKV
from mpic.linker.pipeline import link_and_prefill
from mpic.linker.plan import build_plan, resolve_entries, unique_entries
from mpic.linker.policies import get_policy
from mpic.linker.policies.mpic import MPICPolicy
from mpic.linker.recipe import with_policy
from mpic.types import LinkPlan
from tests.engine.vllm.connector.test_paged_kv_layout import BLOCK, vllm_cache
from tests.linker.toy_model import CONTEXT, IMAGE_ID, ToyAdapter, toy_entries, toy_spec

BS = 32


def _plan(n: int) -> LinkPlan:
    return LinkPlan(
        token_ids=torch.arange(n),
        positions=torch.arange(n),
        source_entry=torch.full((n,), -1),
        source_offset=torch.full((n,), -1),
        entry_ids=[],
        recompute_depth=torch.full((n,), 2),
    )


@dataclass
class FakeRequest:
    request_id: str
    num_prompt_tokens: int
    policy: str = "mpic-32"
    press: bool = False
    kv_transfer_params: dict = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(range(self.num_prompt_tokens))
        self.kv_transfer_params = vllm_params.plan_to_params(
            _plan(self.num_prompt_tokens), self.policy
        )
        if self.press:
            self.kv_transfer_params[vllm_presses.KEY] = {"press": "snapkv", "budget": 0.5}


def _blocks(n: int):
    return SimpleNamespace(get_block_ids=lambda: ([10 + i for i in range(n)],))


def _output(new=(), finished=()):
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[]),
        finished_req_ids=set(finished),
    )


def test_policies_that_batch() -> None:
    assert batchable(get_policy("mpic-32")) and batchable(get_policy("full"))
    assert not batchable(get_policy("cacheblend-15"))  # in-pass hook
    assert not needs_last_token(get_policy("mpic-4"))
    assert needs_last_token(get_policy("cacheblend-15")) and needs_last_token(None)


def test_linked_claims_are_async_and_ship_their_blocks() -> None:
    s = MPICScheduler(BS)
    req = FakeRequest("a", 100)
    assert s.get_num_new_matched_tokens(req, 0) == (99, True)
    assert s.get_num_new_matched_tokens(req, 99) == (0, False)  # nothing left to claim
    s.update_state_after_alloc(req, _blocks(4), 99)
    meta = s.build_connector_meta(_output())
    (job,) = meta.jobs
    assert job.load_async and job.req_id == "a" and job.block_ids == [10, 11, 12, 13]
    assert job.policy_name == "mpic-32" and job.plan().num_tokens == 100
    assert isinstance(job.policy, MPICPolicy) and job.policy.name == "mpic-32"
    assert s.build_connector_meta(_output()).jobs == []  # shipped once
    s.update_connector_output(SimpleNamespace(finished_recving={"a"}))
    assert s.request_finished(req) == (False, None)  # linked already: blocks free at once


def _new(req: FakeRequest, blocks: list[int]):
    return SimpleNamespace(req_id=req.request_id, block_ids=(blocks,), sampling_params=None)


def _claim(s: MPICScheduler, req: FakeRequest, blocks: int = 3) -> LinkJob:
    """Claim, allocate and ship `req`; its one job."""
    assert s.get_num_new_matched_tokens(req, 0)[1] is True
    s.update_state_after_alloc(req, _blocks(blocks), req.num_prompt_tokens - 1)
    (job,) = s.build_connector_meta(_output()).jobs
    return job


def test_every_policy_loads_in_the_background_first() -> None:
    s = MPICScheduler(BS)
    edge = 2 * BS + 1  # N-1 claimed tokens fill 2 blocks: token N-1 has none yet
    assert _claim(s, FakeRequest("p", edge), 2).phase2 == ""  # plain: linked, last token cut
    assert _claim(s, FakeRequest("c2", edge + 1, "cacheblend-15")).phase2 == ""
    assert _claim(s, FakeRequest("sc", 80, "scout-0.2")).phase2 == "shift"
    assert _claim(s, FakeRequest("c", edge, "cacheblend-15"), 2).phase2 == "link"
    assert _claim(s, FakeRequest("se", edge, "scout-0.2"), 2).phase2 == "link"
    assert _claim(MPICScheduler(BS, "reads"), FakeRequest("r", 80, "scout-0.2")).phase2 == "link"
    assert _claim(MPICScheduler(BS, "reads"), FakeRequest("m", 80)).phase2 == ""
    assert s.get_num_new_matched_tokens(FakeRequest("z", 80, press=True), 0)[1] is False
    assert MPICScheduler(BS, async_loads=False).get_num_new_matched_tokens(
        FakeRequest("q", 80), 0
    ) == (79, False)


def test_a_claim_after_a_prefix_hit_is_linked_in_a_step_in_background_mode() -> None:
    """Blocks hit in vLLM's prefix cache are shared (an identical linked request, possibly
    decoding now); a link rewrites them, so never on the linking thread beside a forward."""

    def hit(s: MPICScheduler, req: FakeRequest, computed: int) -> LinkJob:
        assert s.get_num_new_matched_tokens(req, computed) == (79 - computed, True)
        s.update_state_after_alloc(req, _blocks(3), 79 - computed)
        (job,) = s.build_connector_meta(_output()).jobs
        return job

    background = MPICScheduler(BS, True)
    assert hit(background, FakeRequest("h", 80), BS).phase2 == "link"
    assert hit(background, FakeRequest("n", 80), 0).phase2 == ""  # nothing shared
    assert hit(MPICScheduler(BS, "reads"), FakeRequest("r", 80), BS).phase2 == ""  # in a step


def test_second_phase_links_or_shifts_in_the_last_tokens_step() -> None:
    s = MPICScheduler(BS)
    edge, shift, failed = (
        FakeRequest("edge", 2 * BS + 1, "cacheblend-15"),
        FakeRequest("shift", 80, "scout-0.2"),
        FakeRequest("failed", 80, "scout-0.2"),
    )
    for r in (edge, shift, failed):
        s.get_num_new_matched_tokens(r, 0)
        s.update_state_after_alloc(r, _blocks(3), r.num_prompt_tokens - 1)
    assert len(s.build_connector_meta(_output()).jobs) == 3
    s.update_connector_output(
        SimpleNamespace(finished_recving={"edge", "shift", "failed"}, failed_recving={"failed"})
    )
    out = _output([_new(edge, [4, 5, 6]), _new(shift, [7, 8, 9])])
    meta = s.build_connector_meta(out)
    (job,) = meta.jobs
    assert job.req_id == "edge" and not job.load_async and job.block_ids == [4, 5, 6]
    assert out.has_sync_kv_loads  # the worker links it before this step's forward
    assert meta.shift == {"shift"}
    assert s.build_connector_meta(_output([_new(failed, [1])])).jobs == []  # vLLM failed it


def test_a_request_ending_between_its_phases_is_forgotten() -> None:
    s = MPICScheduler(BS)
    req = FakeRequest("gone", 80, "scout-0.2")
    _claim(s, req)
    s.update_connector_output(SimpleNamespace(finished_recving={"gone"}))
    assert s.request_finished(req) == (False, None)  # received: vLLM frees the blocks
    meta = s.build_connector_meta(_output())
    assert meta.forget == {"gone"} and meta.finished == set() and meta.shift == set()


def test_a_request_ending_while_loading_keeps_its_blocks_until_dropped() -> None:
    s = MPICScheduler(BS)
    early, late = FakeRequest("early", 70), FakeRequest("late", 70)
    for r in (early, late):
        s.get_num_new_matched_tokens(r, 0)
        s.update_state_after_alloc(r, _blocks(3), 69)
    assert s.request_finished(early) == (False, None)  # not shipped yet: never seen by workers
    meta = s.build_connector_meta(_output())
    assert [j.req_id for j in meta.jobs] == ["late"]
    assert s.request_finished(late) == (True, None)  # with the worker: wait for its drop
    assert s.build_connector_meta(_output()).finished == {"late"}


MPIC32 = get_policy("mpic-32")
_UNMIRRORED = SimpleNamespace(mirrored=False)  # a request's paged KV without dense mirrors


def test_batch_splits_queries_by_request_and_maps_slots() -> None:
    items = [
        BatchItem(_plan(40), [], _UNMIRRORED, [7, 3], MPIC32),  # request 0: global 0..39
        BatchItem(_plan(5), [], _UNMIRRORED, [9], MPIC32),  # request 1: global 40..44
    ]
    layer = torch.zeros(12, 1, BS, 4)
    kv = BatchedPagedKV(items, [None], [layer], BS)
    index = torch.tensor([0, 1, 2, 38, 39, 40, 41, 44])
    assert kv._pieces(index) == [(0, 3, 0), (3, 5, 0), (5, 7, 1), (7, 8, 1)]
    assert kv._requests(index) == [(0, 5, 0), (5, 8, 1)]  # one range per request
    assert kv._slots[[0, 33, 39, 40, 44]].tolist() == [
        7 * BS,
        3 * BS + 1,
        3 * BS + 7,
        9 * BS,
        9 * BS + 4,
    ]
    assert kv._tables.tolist() == [[7, 3], [9, 0]]


def test_a_batch_of_scouting_requests_links_as_each_alone() -> None:
    # the connector's batched pass over paged blocks (CPU tensors in the FlashAttention layout;
    # every request mirrored, so each request's own KV serves its rows): the scouting requests
    # share one scouting pass and select what each selects alone
    adapter = ToyAdapter(num_layers=6)
    store = toy_entries(adapter)
    prompts = [
        (CONTEXT + [10, IMAGE_ID, 12, IMAGE_ID, 13, 14], ["img-a", "img-b"], "auto"),
        (CONTEXT + [IMAGE_ID, 20, 21], ["img-b"], "mpic-2"),
        (CONTEXT + [11, IMAGE_ID, 9, IMAGE_ID, 15], ["img-b", "img-a"], "scout-0.6:s0.8"),
        (CONTEXT + [IMAGE_ID, 16, 17, 18], ["img-a"], "auto-0.3"),
    ]
    caches = [vllm_cache("nhd", 10, 2, 8) for _ in range(adapter.num_layers)]
    items, refs = [], []
    for r, (prompt, ids, name) in enumerate(prompts):
        found = resolve_entries(ids, store)
        plan = build_plan(toy_spec(adapter), prompt, found)
        planned = with_policy(plan, unique_entries(plan, found), name, adapter.num_layers)
        dense = DenseLinkedKV(adapter.num_layers, plan.num_tokens, 2, 8, backend="sdpa_runs")
        refs.append((link_and_prefill(adapter, planned, dense), dense))
        block_ids = [2 * r + 1, 2 * r]
        shape = (adapter.num_layers, len(block_ids) * BLOCK, 2, 8)
        ops = FlashPagedOps(caches, torch.tensor(block_ids), BLOCK, 8)
        kv = PagedLinkedKV(
            [],
            caches,
            block_ids,
            BLOCK,
            keys=torch.zeros(shape),
            ops=ops,
            values=torch.zeros(shape),
        )
        items.append(BatchItem(planned.plan, planned.entries, kv, block_ids, planned.policy))
    outs = link_batch(adapter, items, [], caches, BLOCK)
    for item, out, (ref, dense) in zip(items, outs, refs, strict=True):
        assert torch.equal(out.plan.recompute_depth, ref.plan.recompute_depth)
        assert out.result.logits is None  # vLLM's forward computes the last token
        index = torch.arange(item.plan.num_tokens)
        for layer in range(adapter.num_layers):
            keys = item.kv.read_keys(layer, index)
            torch.testing.assert_close(keys, dense.keys[layer], rtol=1e-5, atol=1e-5)
    assert [out.scout.requests if out.scout else 0 for out in outs] == [3, 0, 3, 3]


def test_link_job_round_trips_the_plan() -> None:
    req = FakeRequest("j", 33, press=True)
    job = LinkJob.from_request("j", req.prompt_token_ids, [1, 2], req.kv_transfer_params)
    assert job.press is not None and job.press.press == "snapkv" and job.entry_ids == ()
    assert torch.equal(job.plan().recompute_depth, _plan(33).recompute_depth)


def test_a_failed_load_is_freed_by_its_report_not_dropped() -> None:
    # vLLM finishes a request whose load failed before it reads the report (finished_recving):
    # the report frees the blocks, so the request must not also come back as dropped.
    s = MPICScheduler(BS)
    req = FakeRequest("f", 70)
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, _blocks(3), 69)
    s.build_connector_meta(_output())
    assert s.request_finished(req) == (True, None)
    s.update_connector_output(SimpleNamespace(finished_recving={"f"}))
    assert s.build_connector_meta(_output()).finished == set()


def test_a_link_job_carries_its_policy_parsed_once(monkeypatch) -> None:
    """The policy name a request carries is parsed once per claim, by the scheduler half where
    its first job is built: the second phase's job reuses that parse, the job pickles (to the
    worker half) with its `Policy`, and the helpers and the worker's `rule` read that object."""
    import pickle

    from mpic.engine.vllm.connector import link_job, linking
    from mpic.engine.vllm.connector.link_job import links_in_its_forward_step

    parsed: list[str] = []

    def counting(name: str, *args, **kwargs):
        parsed.append(name)
        return get_policy(name, *args, **kwargs)

    monkeypatch.setattr(link_job, "get_policy", counting)
    assert not hasattr(linking, "get_policy")  # the worker's link reads `LinkJob.rule()`
    s = MPICScheduler(BS)
    edge = FakeRequest("edge", 2 * BS + 1, "cacheblend-15")  # two phases: read, then link
    first = _claim(s, edge)
    assert first.phase2 == "link" and parsed == ["cacheblend-15"]
    s.update_connector_output(SimpleNamespace(finished_recving={"edge"}))
    (second,) = s.build_connector_meta(_output([_new(edge, [4, 5, 6])])).jobs
    assert second.policy is first.policy and parsed == ["cacheblend-15"]  # no second parse
    shipped = pickle.loads(pickle.dumps(second))  # vLLM pickles the step's metadata
    assert shipped.policy.name == "cacheblend-15" and shipped.policy_name == "cacheblend-15"
    assert shipped.rule() is shipped.policy
    assert needs_last_token(shipped.policy) and not links_in_its_forward_step(shipped.policy)
    scout = _claim(MPICScheduler(BS), FakeRequest("sc", 80, "scout-0.2"))
    assert scout.phase2 == "shift" and links_in_its_forward_step(scout.policy)
    assert parsed == ["cacheblend-15", "scout-0.2"]


def test_a_job_whose_policy_does_not_parse_fails_in_the_worker() -> None:
    """A name no MPIC front end sends: the scheduler half still claims it (as a policy whose
    pass needs the last token and that is not corrected), and the worker's link raises the
    parse's ValueError (a failed load)."""
    import pytest

    s = MPICScheduler(BS)
    job = _claim(s, FakeRequest("bad", 80, "nonsense-3"))
    assert job.policy is None and job.phase2 == ""  # the last token has its block already
    edge = _claim(s, FakeRequest("edge", 2 * BS + 1, "nonsense-3"), 2)
    assert edge.policy is None and edge.phase2 == "link"
    with pytest.raises(ValueError, match="nonsense-3"):
        job.rule()
