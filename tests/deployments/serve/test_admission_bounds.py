"""Overload is load, never an outage (issue 35 item 5): Serve's back-pressure on an internal hop is
answered 429 `engine_overloaded` with Retry-After; the LLM worker's budget is sized from what
vLLM runs and queues, and the Serve bounds of the deployments on the generation path are derived
from it so the budget refuses before any Serve queue fills; a burst on the fake engine gets only
200s and JSON 429s."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

import pytest

from tests.deployments.http.test_hardening import _app


def _config(**sections):
    from mpic.deployments.config import ServeAppConfig

    return ServeAppConfig.model_validate(sections)


def test_backpressure_maps_to_429_with_retry_after() -> None:
    from mpic.deployments.serve.admission import OverloadedError, as_backpressure

    class BackPressureError(RuntimeError):
        pass

    class Wrapped(RuntimeError):  # Ray's wrappers carry the original as `.cause`
        def __init__(self, cause: BaseException) -> None:
            super().__init__("wrapped")
            self.cause = cause

    for exc in (BackPressureError("num_queued_requests=64"), Wrapped(BackPressureError("x"))):
        busy = as_backpressure(exc)
        assert isinstance(busy, OverloadedError)
        assert (busy.status, busy.type, busy.code) == (429, "rate_limit_error", "engine_overloaded")
        assert busy.retry_after == 1 and "num_queued" not in busy.message
        assert busy.retry_after_ms == 1000  # the same wait for OpenAI's clients
    assert as_backpressure(RuntimeError("other")) is None


def test_retry_wait_clamps_and_rounds_up() -> None:
    """One recipe for every refusal's wait: clamped to [1 s, 60 s], `retry-after-ms` rounded up
    to the millisecond, `Retry-After` to the second (never earlier than the ms value)."""
    from mpic.deployments.serve.admission import RETRY_AFTER_MAX_S, retry_headers, retry_wait

    assert retry_wait(0.0) == (1, 1000) and retry_wait(0.4) == (1, 1000)
    assert retry_wait(1.0) == (1, 1000)
    assert retry_wait(1.2345) == (2, 1235)
    assert retry_wait(8 / 1.6) == (5, 5000)  # float noise does not round up a whole second
    assert retry_wait(500.0) == (RETRY_AFTER_MAX_S, RETRY_AFTER_MAX_S * 1000)
    assert retry_wait(float("inf")) == (60, 60000) and retry_wait(float("nan")) == (60, 60000)
    assert retry_wait(3.5, max_s=2) == (2, 2000)
    assert retry_headers(2, 1235) == [(b"retry-after", b"2"), (b"retry-after-ms", b"1235")]
    assert retry_headers(1) == [(b"retry-after", b"1")]


def test_budget_refusal_announces_its_littles_law_wait() -> None:
    """The worker's budget tells a refused request when a slot is likely free: its generations
    leave at about `in flight / mean generation time` per second (Little's law), so one slot
    frees in `mean / in flight` seconds, at least `limits.retry_after_s` (also before any
    generation finished)."""
    from mpic.deployments.serve.admission import EngineBudget, OverloadedError

    now = [0.0]
    budget = EngineBudget(2, 10_000, retry_after_s=1, clock=lambda: now[0])
    with budget.admit(10), budget.admit(10):
        with pytest.raises(OverloadedError) as err:
            with budget.admit(10):
                pass
        assert (err.value.retry_after, err.value.retry_after_ms) == (1, 1000)  # nothing timed
        now[0] += 7.0  # two generations of 7 s
    assert budget.mean_s == pytest.approx(7.0)
    with budget.admit(10), budget.admit(10):
        with pytest.raises(OverloadedError) as err:
            with budget.admit(10):
                pass
        # 2 in flight, 7 s each: a slot frees about every 3.5 s
        assert (err.value.retry_after, err.value.retry_after_ms) == (4, 3500)
        assert "retry after 4 s" in err.value.message
    # the moving mean follows shorter generations; the floor holds
    for _ in range(200):
        with budget.admit(10):
            now[0] += 0.1
    with budget.admit(10), budget.admit(10):
        with pytest.raises(OverloadedError) as err:
            with budget.admit(10):
                pass
        assert (err.value.retry_after, err.value.retry_after_ms) == (1, 1000)
    # the ms value crosses Ray's hop with the error (pickled) and reaches the header
    import pickle

    from mpic.deployments.http.http_errors import mpic_error_response

    crossed = pickle.loads(
        pickle.dumps(OverloadedError("busy", retry_after=4, retry_after_ms=3500))
    )
    resp = mpic_error_response(crossed)
    assert resp.status_code == 429
    assert (resp.headers["retry-after"], resp.headers["retry-after-ms"]) == ("4", "3500")


def test_worker_capacity_from_vllm_batch_and_kv() -> None:
    from mpic.deployments.serve.admission import worker_capacity

    # reference / fake engines: the limits as configured
    assert worker_capacity(_config(engine={"kind": "fake"})) == (32, 65536)
    # vLLM: max_num_seqs running + one batch waiting (default), at most the limit
    assert worker_capacity(_config(engine={"kind": "vllm", "max_num_seqs": 4}))[0] == 8
    assert worker_capacity(_config(engine={"kind": "vllm", "max_num_seqs": 64}))[0] == 32
    cfg = _config(engine={"kind": "vllm", "max_num_seqs": 4}, limits={"engine_queue_seqs": 0})
    assert worker_capacity(cfg)[0] == 4
    # tokens: the KV cache's blocks (vLLM's reported count wins over the configured one)
    cfg = _config(engine={"kind": "vllm", "num_blocks": 10, "block_size": 32})
    assert worker_capacity(cfg) == (32, 320)
    assert worker_capacity(cfg, num_gpu_blocks=100) == (32, 3200)
    assert worker_capacity(cfg, num_gpu_blocks=10**6)[1] == 65536  # the limit still bounds it


def test_engine_batch_for_the_ingress_cold_start() -> None:
    """What the engine starts at once, one ingress replica's share (the ingress's cold-start
    bound, `mpic.deployments.http.shedding`): vLLM's max_num_seqs times the LLM-worker replicas
    over the ingress replicas; None for an engine that does not batch."""
    from mpic.deployments.serve.admission import engine_batch

    assert engine_batch(_config(engine={"kind": "vllm"})) == 16  # vLLM's default max_num_seqs
    assert engine_batch(_config(engine={"kind": "vllm", "max_num_seqs": 4})) == 4
    two = {"autoscaling": {"min_replicas": 2, "max_replicas": 2}}
    assert engine_batch(_config(engine={"kind": "vllm"}, llm_worker=two)) == 32
    assert engine_batch(_config(engine={"kind": "vllm"}, llm_worker=two, ingress=two)) == 16
    three = {"autoscaling": {"min_replicas": 3, "max_replicas": 3}}
    assert engine_batch(_config(engine={"kind": "vllm", "max_num_seqs": 2}, ingress=three)) == 1
    assert engine_batch(_config(engine={"kind": "fake"})) is None
    assert engine_batch(_config(engine={"kind": "reference"})) is None


def _bound(app) -> dict[str, tuple[int, int]]:
    """name -> (max_ongoing_requests, max_queued_requests) of every bound deployment."""
    out = {}
    for a in [app, *app._bound_deployment.init_args[1:]]:
        dep = a._bound_deployment
        c = dep._deployment_config
        out[dep.name] = (c.max_ongoing_requests, c.max_queued_requests)
    return out


def test_serve_bounds_derived_from_the_worker_budget() -> None:
    pytest.importorskip("ray")
    from mpic.deployments.app import build_app
    from mpic.deployments.serve.admission import WORKER_SIDE_CALLS

    got = _bound(build_app(_config(engine={"kind": "fake"})))
    # every generation reaches the budget (429), no queue on the generation path fills first
    assert got["LLMWorker"] == (32 + WORKER_SIDE_CALLS, -1)
    assert got["Resolver"] == (16, -1) and got["Retriever"] == (16, -1)
    assert got["Encoder"] == (16, 64)  # uploads: not on the generation path
    vllm = _config(engine={"kind": "vllm", "model": "absent-model", "max_num_seqs": 8})
    assert _bound(build_app(vllm))["LLMWorker"] == (16 + WORKER_SIDE_CALLS, -1)
    # values set in the config win; without the TTFT admission the queues keep their bounds
    explicit = _config(
        engine={"kind": "fake"},
        llm_worker={"max_ongoing_requests": 5, "max_queued_requests": 7},
        limits={"ttft_target_s": 0},
    )
    got = _bound(build_app(explicit))
    assert got["LLMWorker"] == (5, 7) and got["Resolver"] == (16, 64)


def test_vllm_worker_on_cpu_spins_its_openmp_threads_briefly(monkeypatch) -> None:
    """A vLLM LLM worker without a GPU gets GOMP_SPINCOUNT=30000 in its runtime_env (spinning
    long between steps, its OpenMP threads held the cores Serve's proxy and the ingress needed;
    not spinning at all slowed every linked prefill); not on a GPU, not for other engines, and
    the operator's own OpenMP wait setting (either knob) wins."""
    pytest.importorskip("ray")
    from mpic.deployments.app import build_app

    def worker_env(cfg, overrides=None) -> dict:
        app = build_app(cfg, overrides)
        worker = app._bound_deployment.init_args[3]._bound_deployment
        assert worker.name == "LLMWorker"
        return (worker.ray_actor_options.get("runtime_env") or {}).get("env_vars") or {}

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    vllm = {"kind": "vllm", "model": "absent-model"}
    assert worker_env(_config(engine=vllm)) == {"GOMP_SPINCOUNT": "30000"}
    assert worker_env(_config(engine=vllm, llm_worker={"num_gpus": 1})) == {}
    assert worker_env(_config(engine={"kind": "fake"})) == {}
    # a runtime_env of the deployments' overrides keeps its values and gets the default beside
    ray_opts = {"ray_actor_options": {"num_cpus": 1, "runtime_env": {"env_vars": {"A": "1"}}}}
    env = worker_env(_config(engine=vllm), {"LLMWorker": ray_opts})
    assert env == {"A": "1", "GOMP_SPINCOUNT": "30000"}
    for knob, value in (("OMP_WAIT_POLICY", "PASSIVE"), ("GOMP_SPINCOUNT", "0")):
        monkeypatch.setenv(knob, value)
        assert worker_env(_config(engine=vllm)) == {}
        monkeypatch.delenv(knob)


def test_burst_on_the_worker_budget_gets_only_200_and_429(tmp_path: Path) -> None:
    """24 streams at once against a budget of 4 (fake engine, 50 ms per token): each answer is a
    200 or an OpenAI-style JSON 429 with Retry-After, never a 503."""
    limits = {"max_requests_in_flight": 4}
    with _app(tmp_path, limits=limits, engine={"fake_token_delay_s": 0.05}) as app:
        gate = threading.Barrier(24)
        answers: list[tuple[int, dict, bytes]] = []
        lock = threading.Lock()

        def one(i: int) -> None:
            body = {
                "model": "mpic",
                "stream": True,
                "max_tokens": 8,
                "messages": [{"role": "user", "content": f"burst {i} " + "cat " * 8}],
            }
            gate.wait(10)
            h = app.headers("alice-key")
            with app.client.stream("POST", "/v1/chat/completions", headers=h, json=body) as r:
                content = r.read()
                with lock:
                    answers.append((r.status_code, dict(r.headers), content))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    statuses = Counter(s for s, _, _ in answers)
    assert len(answers) == 24 and set(statuses) <= {200, 429}, statuses
    assert statuses[200] >= 1 and statuses[429] >= 1, statuses
    for status, headers, content in answers:
        if status == 429:
            err = json.loads(content)["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["code"] in ("engine_overloaded", "server_overloaded"), err
            assert int(headers["retry-after"]) >= 1
