"""`mpic bench online` without a vLLM engine: its requests are the vLLM front end's own
(`VllmFrontEnd.prepare`, entries computed by the reference runner, which names them alike), every
system gets the same prompt, and the saturation rule (p99 / p95 under 2x unloaded, a system
stopped after its first failing rate, the ratio to prefix caching) computes what the docs say."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mpic.benchmarks.online import bench as online
from mpic.benchmarks.online import results as online_results
from mpic.benchmarks.online import workload as online_workload
from mpic.benchmarks.online.results import RatePoint, SystemCurve, summary


@pytest.fixture(scope="module")
def workloads(tiny_llava_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    from mpic.engine.hf.reference_runner import ReferenceRunner
    from mpic.engine.vllm.config import VllmEngineConfig
    from mpic.engine.vllm.frontend import VllmFrontEnd
    from mpic.storage.config import StorageConfig

    ref = ReferenceRunner(str(tiny_llava_dir))
    store = StorageConfig(url=tmp_path_factory.mktemp("store").as_uri(), fsync=False)
    front = VllmFrontEnd(VllmEngineConfig(model=str(tiny_llava_dir), storage=store))
    front.cache_image, front.cache_document = ref.cache_image, ref.cache_document  # no vLLM
    with pytest.MonkeyPatch.context() as mp:  # short documents: the tiny model's 2,048 tokens
        words = " ".join(online_workload.WORDS[:30])
        mp.setattr(online_workload, "document", lambda seed: f"Item {seed}: {words}")
        return {
            kind: online_workload.Workload(front, kind, users=2, per_user=4, seed=3)
            for kind in ("image", "text")
        }


@pytest.mark.parametrize("kind", ["image", "text"])
def test_every_system_gets_the_same_prompt_from_the_front_end(workloads: dict, kind: str) -> None:
    from mpic.engine.hf.vision import load_image
    from mpic.engine.vllm.requests import collapse_placeholders

    work = workloads[kind]
    front, image_id = work.engine, work.engine.spec.image_token_id
    (chat,) = online.make_chats(1, users=2, per_user=4, items=3, seed=5)
    refs = [work.entries[p].entry_id for p in chat.parts if isinstance(p, int)]
    assert len(refs) == 3 and len(set(refs)) == 3  # three of the user's own items
    prefix = work.request(chat, "prefix", 4)
    full = [work.request(chat, "full", 4) for _ in range(2)]
    linked = {s: work.request(chat, s, 4) for s in ("mpic-32", "auto")}

    # exact requests: the same ids, prefix caching unsalted, full with a fresh salt each time
    assert prefix.plan is None and prefix.cache_salt is None
    assert all(r.plan is None and r.prompt_token_ids == prefix.prompt_token_ids for r in full)
    assert full[0].cache_salt and full[0].cache_salt != full[1].cache_salt
    if kind == "image":  # the chat's images, in prompt order, as the items' own pixels
        got = prefix.multi_modal_data["image"]
        want = [load_image(work.media[r]) for r in refs]
        assert [np.asarray(g).tolist() for g in got] == [np.asarray(w).tolist() for w in want]
        assert prefix.prompt_token_ids.count(image_id) == 3
    else:
        assert prefix.multi_modal_data is None and image_id not in prefix.prompt_token_ids

    # linked requests: the same prompt as the exact one, the front end's policy name
    for system, req in linked.items():
        assert req.policy == front.policy_name(system)
        ids = req.plan.token_ids.tolist()
        assert collapse_placeholders(ids, image_id) == prefix.prompt_token_ids
        assert (
            req.cache_salt
            and req.cache_salt != linked["mpic-32" if system == "auto" else "auto"].cache_salt
        )
        assert callable(req.fallback)  # media given: a failed link answers exactly


def _point(rate: float, p50: float, p95: float, p99: float, grid: bool = True) -> RatePoint:
    return RatePoint(rate, 40, p50, p95, p99, throughput=rate, grid=grid)


def _curve(unloaded: float, pts: list[tuple[float, float, float]]) -> SystemCurve:
    c = SystemCurve("x", unloaded)
    c.points = [_point(r, p95 / 2, p95, p99) for r, p95, p99 in pts]
    return c


def test_saturation_is_the_highest_rate_under_2x_unloaded_and_when_a_system_stops() -> None:
    c = _curve(100, [(0.25, 150, 250), (0.5, 150, 199), (1, 180, 200)])
    assert c.saturation() == 0.5 and c.first_failure() == 0.25  # a spike at 0.25: p99 250
    assert c.saturation("p95") == 1 and c.first_failure("p95") is None
    assert not c.stopped()  # one failing p99 (1/s), its p50 under the bound: go on
    c.points.append(_point(1.5, 90, 150, 210))
    assert c.stopped() and c.saturation() == 0.5  # two p99 failures in a row
    assert _curve(100, [(0.25, 150, 250)]).saturation() == 0.0
    assert _curve(100, [(0.25, 150, 190), (0.5, 400, 400)]).stopped()  # p50 past the bound
    c.points.append(_point(0.1, 1, 1, 1, grid=False))  # off-grid: not in the rule
    assert c.saturation() == 0.5 and c.at(0.1).ttft_p99_ms == 1


def test_summary_ratio_and_half_prefix_point() -> None:
    prefix = _curve(100, [(0.25, 110, 150), (0.5, 150, 180), (0.75, 190, 260)])
    prefix.system = "prefix"
    mpic = _curve(50, [(0.5, 60, 70), (1, 60, 70), (1.5, 70, 99), (2, 90, 120)])
    mpic.system = "mpic-32"
    mpic.points.append(_point(0.25, 50, 55, 58, grid=False))
    full = _curve(100, [(0.5, 150, 180)])
    full.system = "full"
    s = summary([prefix, mpic, full])
    assert s["saturation_rate_p99"] == {"prefix": 0.5, "mpic-32": 1.5, "full": 0.5}
    assert s["ratio_vs_prefix_p99"] == {"mpic-32": 3.0}
    assert s["ratio_vs_prefix_p95"] == {"mpic-32": 2 / 0.75}  # all p95 held
    assert s["half_prefix_rate"] == 0.25
    at_half = s["ttft_at_half_prefix_rate_ms"]
    assert at_half["mpic-32"]["p99"] == 58 and at_half["prefix"]["p99"] == 150
    assert at_half["full"] is None
    prefix.points = prefix.points[2:]  # held at no rate: the ratio is a lower bound
    assert summary([prefix, mpic])["ratio_vs_prefix_p99"] == {"mpic-32": ">= 2"}


def test_json_round_trip_rebuilds_the_curves(tmp_path: Path) -> None:
    c = _curve(100, [(0.25, 150, 190), (0.5, 150, 250)])
    c.points[0].ttfts_ms = [1.5, 2.5]
    online_results.write_outputs({"m": [c]}, {"seed": 0}, tmp_path)
    results, meta = online_results.load_results(tmp_path / "online.json")
    assert meta == {"seed": 0} and results == {"m": [c]}
    assert (tmp_path / "online.png").stat().st_size > 1000


def test_run_model_order_stop_rule_and_half_prefix_point(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver without an engine: prefix caching first, each system stopped as the rule says,
    the MPIC systems and prefix caching (not full) measured at half prefix's saturation rate on
    one seed, the same seed per grid rate for every system."""
    import mpic.engine.vllm.async_engine as async_engine

    class Engine:
        fallbacks = 0

        def __init__(self, cfg) -> None:
            self.closed = False

        def close(self) -> None:
            Engine.closed = True

    class Work:
        entries = []

        def __init__(self, engine, *args) -> None:
            self.engine = engine

    # p99 (ms) per system and rate; unloaded 100 ms: the bound is 200
    p99 = {
        "prefix": {0.5: 150, 1: 250, 2: 300, 3: 100, 0.25: 110},  # stops after 1, 2: sat 0.5
        "mpic-32": {0.5: 150, 1: 150, 2: 150, 3: 150, 4: 150, 0.25: 120},
        "full": {0.5: 150, 1: 150, 2: 150, 3: 150, 4: 150},
    }
    calls = []

    def fake_rate(work, system, chats, rate, max_tokens, seed, grid=True) -> RatePoint:
        calls.append((system, rate, seed, grid, len(chats)))
        p50 = 500 if (system == "full" and rate == 2) else 100  # full: p50 past the bound
        return _point(rate, p50, p99[system][rate], p99[system][rate], grid)

    monkeypatch.setattr(async_engine, "AsyncVllmEngine", Engine)
    monkeypatch.setattr(online_workload, "Workload", Work)
    monkeypatch.setattr(online, "unloaded", lambda *a, **k: [100.0] * 3)
    monkeypatch.setattr(online, "run_rate", fake_rate)
    run = online.RunSettings([0.5, 1, 2, 3, 4], 8, 3, 3, 2, 4, 4, 7)
    seen = []
    curves = online.run_model("m", "model", "image", ["mpic-32", "full", "prefix"], run,
                              on_curve=lambda c: seen.append(len(c[-1].points)))  # fmt: skip
    assert Engine.closed
    assert [c.system for c in curves] == ["prefix", "mpic-32", "full"]
    by = {c.system: [(p.rate, p.grid) for p in c.points] for c in curves}
    assert by["prefix"] == [(0.25, False), (0.5, True), (1, True), (2, True)]
    assert by["mpic-32"] == [(0.25, False)] + [(r, True) for r in (0.5, 1, 2, 3, 4)]
    assert by["full"] == [(0.5, True), (1, True), (2, True)]  # p50 past the bound at 2/s
    seeds = {(s, r): seed for s, r, seed, _, _ in calls}
    assert seeds[("prefix", 2)] == seeds[("mpic-32", 2)] == seeds[("full", 2)] == 9
    assert seeds[("mpic-32", 0.25)] == 57 and ("full", 0.25) not in seeds
    assert seeds[("prefix", 0.25)] == 57
    assert summary(curves)["ratio_vs_prefix_p99"] == {"mpic-32": 8.0}
    assert seen[0] == 1  # written after the first point already
