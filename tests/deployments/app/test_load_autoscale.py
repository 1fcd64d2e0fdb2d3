"""Load on the session's real Ray Serve instance: a short bounded run of `benchmarks/load/bench.py`
(no errors, TTFT and tokens/s measured) and Serve autoscaling: with the LLM worker's
`target_ongoing_requests=1`, concurrent streaming clients make Serve add a second replica."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.deployments.conftest import ServeApp

pytestmark = pytest.mark.slow


def _running(deployment: str) -> int:
    from ray import serve

    dep = serve.status().applications["mpic"].deployments[deployment]
    return dep.replica_states.get("RUNNING", 0)


def test_low_target_ongoing_requests_adds_a_replica(serve_app: ServeApp) -> None:
    from mpic.benchmarks.load.bench import run_load_async, upload_images

    assert serve_app.config.llm_worker.autoscaling.target_ongoing_requests == 1
    before = _running("LLMWorker")
    ids = upload_images(serve_app.url, "alice-key", 2)
    done = threading.Event()

    def load() -> None:
        while not done.is_set():
            asyncio.run(
                run_load_async(
                    serve_app.url,
                    "alice-key",
                    ids,
                    clients=6,
                    duration_s=3,
                    policy="full",
                    max_tokens=16,
                )
            )

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and _running("LLMWorker") < 2:
            time.sleep(1)
        assert before == 1 and _running("LLMWorker") == 2
    finally:
        done.set()
        thread.join(timeout=60)


def test_short_load_run(serve_app: ServeApp, tmp_path) -> None:
    from mpic.benchmarks.load.bench import run_load_async, upload_images
    from mpic.benchmarks.load.report import write_outputs

    ids = upload_images(serve_app.url, "alice-key", 2)
    res = asyncio.run(
        run_load_async(
            serve_app.url, "alice-key", ids, clients=4, duration_s=4, policy="mpic-4", max_tokens=4
        )
    )
    assert res.errors == 0, res.error_samples
    assert res.requests >= 4 and res.output_tokens == 4 * res.requests
    assert 0 < res.ttft_p50_s <= res.ttft_p99_s < 30
    write_outputs(res, str(tmp_path / "load.json"), str(tmp_path / "load.png"))
    assert (tmp_path / "load.json").stat().st_size > 0 and (tmp_path / "load.png").exists()
