"""The connector worker half's linking thread without an engine (fast): what it reports when a
link finishes, when its request ends meanwhile, and when the pass raises; the pacer's share."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from mpic.engine.vllm.connector.link_job import LinkJob
from mpic.engine.vllm.connector.model_lock import LinkPacer, ModelLock, YieldingAdapter
from mpic.linker.policies import get_policy
from mpic.storage.config import StorageConfig

connector_worker = pytest.importorskip("mpic.engine.vllm.connector.worker")


def _job(rid: str) -> LinkJob:
    return LinkJob(rid, [1, 2, 3], [0], "mpic-32", get_policy("mpic-32"), (), {}, load_async=True)


def _worker(tmp_path, link) -> connector_worker.MPICWorker:
    w = connector_worker.MPICWorker(32, StorageConfig(url=tmp_path.as_uri()))
    w._link_all = link  # the pass itself: see test_vllm_linking.py for real ones
    return w


def _wait(w: connector_worker.MPICWorker) -> None:
    assert w._linking_future is not None
    w._linking_future.result(timeout=10)


def test_linked_in_the_background_then_reported_received(tmp_path) -> None:
    gate = threading.Event()
    seen: list[str] = []

    def link(ready, paced=False):
        gate.wait(10)
        seen.append(threading.current_thread().name)
        for job, _ in ready:
            w._linked([job], time.perf_counter())

    w = _worker(tmp_path, link)
    w._ready = [(_job("a"), []), (_job("b"), [])]
    w._start_linking()
    assert w.transfer_results().finished_recving == set()  # still linking
    w._drop("b")  # ended meanwhile: reported as dropped once linked, never as received
    gate.set()
    _wait(w)
    out = w.transfer_results()
    assert out.finished_recving == {"a"} and out.finished_sending == {"b"}
    assert seen[0].startswith("mpic-link") and w.stats["linked_requests"] == 2
    w.shutdown()


def test_a_pass_counts_its_one_scouting_pass(tmp_path) -> None:
    w = _worker(tmp_path, None)
    scouted = SimpleNamespace(scout=SimpleNamespace(layers_run=3))
    plain = SimpleNamespace(scout=None)
    w._linked([_job("a"), _job("b"), _job("c")], time.perf_counter(), [scouted, plain, scouted])
    w._linked([_job("d")], time.perf_counter(), [plain])
    assert w.stats["link_passes"] == 2 and w.stats["linked_requests"] == 4
    assert w.stats["scout_passes"] == 1 and w.stats["scouted_requests"] == 2
    assert w.stats["largest_scout_pass"] == 2
    w.shutdown()


def test_a_raising_pass_fails_its_unreported_jobs(tmp_path) -> None:
    def link(ready, paced=False):
        w._linked([ready[0][0]], time.perf_counter())
        raise AssertionError("boom")

    w = _worker(tmp_path, link)
    w._ready = [(_job("ok"), []), (_job("bad"), [])]
    w._start_linking()
    _wait(w)
    out = w.transfer_results()
    assert out.finished_recving == {"ok", "bad"} and out.failed_recving == {"bad"}
    w.shutdown()


def test_a_ready_job_dropped_before_linking_is_never_linked(tmp_path) -> None:
    w = _worker(tmp_path, lambda ready, paced=False: pytest.fail("linked a dropped job"))
    w._ready = [(_job("x"), [])]
    w._drop("x")
    w._start_linking()
    assert w._linking_future is None and w.transfer_results().finished_sending == {"x"}
    w._drop("y")  # unknown (already reported): nothing to report
    assert w.transfer_results().finished_sending == set()
    w.shutdown()


class _Adapter:
    num_layers = 2

    def attention_inputs(self, layer, hidden, positions):
        time.sleep(0.02)
        return hidden, hidden, hidden

    def attention_output_and_mlp(self, layer, hidden, attn_out):
        return hidden


def test_pacer_sleeps_its_share_complement_only_while_decoding() -> None:
    decoding = [True]
    pacer = LinkPacer(0.25, lambda: decoding[0])
    lock = ModelLock()
    adapter = YieldingAdapter(_Adapter(), lock, pacer)  # the linking thread's adapter
    assert adapter.num_layers == 2  # other attributes pass through
    pacer.start()
    x = torch.zeros(1)
    with lock.linking():
        adapter.attention_inputs(0, x, x)
        assert pacer.slept_s >= 3 * 0.02 * 0.9  # worked >= 20 ms -> slept 3x that
        decoding[0] = False
        slept = pacer.slept_s
        adapter.attention_inputs(0, x, x)
        assert pacer.slept_s == slept  # nothing decodes: full speed
    with pytest.raises(ValueError):
        LinkPacer(0, lambda: True)


def test_the_step_and_the_linking_thread_never_run_the_model_together() -> None:
    """vLLM's CPU kernels share per-layer handler state and one scratchpad (model_lock): a
    step and the linking thread take turns, the step waiting for one layer at most."""
    from mpic.engine.vllm.connector.model_lock import guard_runner

    lock = ModelLock()
    inside: list[str] = []
    overlap: list[tuple[str, ...]] = []

    def enter(who: str) -> None:
        if inside:
            overlap.append((*inside, who))
        inside.append(who)
        time.sleep(0.002)
        inside.remove(who)

    class Runner:
        def execute_model(self, n: int) -> int:
            enter("step")
            return n + 1

    class Adapter:
        num_layers = 40

        def attention_inputs(self, layer, hidden, positions):
            enter("link")
            return hidden

        def attention_output_and_mlp(self, layer, hidden, attn_out):
            enter("link")
            return hidden

    runner = Runner()
    guard_runner(runner, lock)
    guard_runner(runner, lock)  # once per runner
    adapter = YieldingAdapter(Adapter(), lock)
    started = threading.Event()

    def link() -> None:
        with lock.linking():
            started.set()
            for layer in range(adapter.num_layers):
                adapter.attention_inputs(layer, None, None)
                adapter.attention_output_and_mlp(layer, None, None)

    thread = threading.Thread(target=link)
    thread.start()
    started.wait(5)
    steps = [runner.execute_model(i) for i in range(20)]  # while the link runs
    thread.join(10)
    assert steps == list(range(1, 21)) and not overlap
    assert lock.steps_waited > 0  # the link held the model when steps came: they took turns
