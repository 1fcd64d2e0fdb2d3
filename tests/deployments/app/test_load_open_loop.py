"""`mpic bench load --rate` (issue 16): open-loop Poisson arrivals against a real HTTP server (the
application in-process on the fake engine behind uvicorn, a small engine budget): every request
is admitted or rejected with 429 + Retry-After (none is an error), admitted TTFT stays bounded,
and dropped streams do not delay the next request."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

from tests.deployments.conftest import ADMIN_KEY, KEYS
from tests.deployments.inprocess import fake_config, in_process_app


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_open_loop_overload_is_refused_fast(tmp_path: Path) -> None:
    import uvicorn

    from mpic.benchmarks.load.bench import run_load_async, upload_images
    from mpic.benchmarks.load.report import write_outputs
    from mpic.deployments.http.ingress import app as fastapi_app

    cfg = fake_config(tmp_path / "store", fake_token_delay_s=0.05)
    cfg = cfg.model_copy(
        update={"limits": cfg.limits.model_copy(update={"max_requests_in_flight": 2})}
    )
    with in_process_app(cfg, KEYS, [ADMIN_KEY]):
        port = _port()
        server = uvicorn.Server(
            uvicorn.Config(fastapi_app, host="127.0.0.1", port=port, log_level="warning")
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        try:
            url = f"http://127.0.0.1:{port}"
            ids = upload_images(url, "alice-key", 1)
            res = asyncio.run(
                run_load_async(
                    url, "alice-key", ids, 0, 3.0, "mpic-4", 8, rate=30.0, abandon=4, seed=1
                )
            )
        finally:
            server.should_exit = True
            thread.join(10)
    write_outputs(res, str(tmp_path / "load.json"), str(tmp_path / "load.png"))
    assert res.mode == "open" and res.sent >= 50
    assert res.errors == 0, res.error_samples
    assert res.requests + res.rejected == res.sent
    assert res.rejected > 0 and set(res.rejected_by_status) == {"429"}
    assert res.rejected_without_retry_after == 0
    assert res.rejected_latency_p99_s < 2.0  # one process, 2 shared cores: still no queueing
    # loose bounds (a fake engine: the point is that admitted requests do not queue behind the
    # rejected or abandoned ones, which would take the whole run's 3 s)
    assert res.requests >= 10 and res.ttft_p99_s < 2.0
    assert res.after_abandon_s is not None and res.after_abandon_s < 2.0
    assert (tmp_path / "load.png").stat().st_size > 0
