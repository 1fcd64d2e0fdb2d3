"""Readiness (issue 22 item 4): until every deployment can serve, `GET /readyz` and chats answer
a fast JSON 503 `not_ready` with Retry-After, while `/healthz` (liveness) answers 200.

Fast tests drive `AppReadiness` with probe functions and the in-process app (always ready); the
slow one deploys a second Serve application whose LLM worker takes 25 s to start and sends a
chat meanwhile: it must be answered 503 within 1 s, and served once the worker is up."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest

from mpic.deployments.http.readiness import AppReadiness, NotReadyError
from tests.deployments.conftest import ServeApp, serve_config


def test_not_ready_until_every_deployment_can_serve() -> None:
    states = {"Ingress": True, "LLMWorker": False}
    ready = AppReadiness(lambda: dict(states), period_s=0.05, ready_period_s=0.05)

    async def run() -> None:
        with pytest.raises(NotReadyError) as err:
            await ready.require()
        assert err.value.status == 503 and err.value.retry_after >= 1
        assert "LLMWorker" in err.value.message
        states["LLMWorker"] = True
        await asyncio.sleep(0.2)
        await ready.require()  # ready now
        states["LLMWorker"] = False  # a replica died: not ready again
        await asyncio.sleep(0.2)
        assert not await ready.check()

    asyncio.run(run())


def test_a_served_chat_outdates_a_probe_that_began_before_it() -> None:
    """After a worker restart Serve's router routes to the new replica at once, while a probe
    (`serve.status()`, seconds on a busy host) may still answer what it saw when it began: the
    chat after the first one served must not get a 503 from that stale answer."""
    states = {"Ingress": True, "LLMWorker": False}
    began = threading.Event()

    def slow_probe() -> dict[str, bool]:
        seen = dict(states)  # the state when the probe began
        began.set()
        time.sleep(0.3)
        return seen

    ready = AppReadiness(slow_probe, period_s=0.01, ready_period_s=0.01, probe_timeout_s=1.0)

    async def run() -> None:
        assert not await ready.check()
        began.clear()
        while not began.is_set():  # a probe is under way, seeing LLMWorker still starting
            await asyncio.sleep(0.005)
        states["LLMWorker"] = True  # the replacement is up and a chat is served by it
        ready.served()
        await ready.require()
        await asyncio.sleep(0.45)  # the stale probe has answered "not ready" meanwhile
        await ready.require()
        states["LLMWorker"] = False  # the replica dies later: probes after the chat count
        await asyncio.sleep(0.8)
        assert not await ready.check()

    asyncio.run(run())


def test_polls_slow_down_once_ready() -> None:
    """`serve.status()` is not free (it serialises the app's config): fast polls while the
    application starts, `ready_period_s` apart once it is ready."""
    states = {"Ingress": True, "LLMWorker": False}
    calls: list[float] = []

    def probe() -> dict[str, bool]:
        calls.append(time.monotonic())
        return dict(states)

    ready = AppReadiness(probe, period_s=0.02, ready_period_s=0.5)

    async def run() -> None:
        assert not await ready.check()
        await asyncio.sleep(0.3)
        starting = len(calls)
        assert starting >= 5  # 0.02 s apart while starting
        states["LLMWorker"] = True
        await asyncio.sleep(0.1)
        assert await ready.check()
        settled = len(calls)
        await asyncio.sleep(0.4)
        assert len(calls) - settled <= 1  # 0.5 s apart once ready

    asyncio.run(run())


def test_on_ready_is_called_each_time_readiness_turns_on() -> None:
    """The Ingress asks the LLM worker its context length from this hook, before the first
    `/v1/models` does."""
    states = {"Ingress": True, "LLMWorker": False}
    calls: list[bool] = []
    ready = AppReadiness(
        lambda: dict(states), period_s=0.02, ready_period_s=0.02, on_ready=lambda: calls.append(1)
    )

    async def run() -> None:
        assert not await ready.check()
        await asyncio.sleep(0.1)
        assert calls == []
        states["LLMWorker"] = True
        await asyncio.sleep(0.1)
        assert await ready.check() and calls == [1]  # once, not at every poll
        states["LLMWorker"] = False
        await asyncio.sleep(0.1)
        ready.served()  # a served chat turns it on again
        assert calls == [1, 1]

    asyncio.run(run())


def test_a_hanging_probe_answers_not_ready_fast() -> None:
    ready = AppReadiness(lambda: time.sleep(30) or {}, period_s=0.1, probe_timeout_s=0.3)

    async def run() -> float:
        began = time.perf_counter()
        assert not await ready.check()
        return time.perf_counter() - began

    assert asyncio.run(run()) < 1.0


def test_in_process_app_is_ready(fake_app) -> None:
    resp = fake_app.client.get("/readyz")
    assert resp.status_code == 200 and resp.json() == {"status": "ready"}


@pytest.mark.slow
def test_chat_while_the_worker_starts_gets_503_within_a_second(
    serve_app: ServeApp, tiny_llava_dir: Path, tmp_path: Path
) -> None:
    from ray import serve

    from mpic.deployments.app import build_app
    from mpic.deployments.config import engine_config

    cfg = serve_config(tiny_llava_dir, tmp_path / "store")
    engine = engine_config(
        kind="tests.deployments.slow_start:SlowStartEngine",
        model="fake-model",
        options={"start_delay_s": 25},
    )
    cfg = cfg.model_copy(update={"name": "slow", "route_prefix": "/slow", "engine": engine})
    deploying = threading.Thread(
        target=serve.run, args=(build_app(cfg),), kwargs={"name": "slow", "route_prefix": "/slow"}
    )
    deploying.start()
    url = f"{serve_app.url}/slow"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the ingress answers liveness first
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert deploying.is_alive(), "the worker should still be starting"
        body = {"model": "mpic", "messages": [{"role": "user", "content": "hello there"}]}
        began = time.perf_counter()
        resp = httpx.post(
            f"{url}/v1/chat/completions",
            json=body,
            headers={"Authorization": "Bearer alice-key"},
            timeout=30,
        )
        took = time.perf_counter() - began
        assert resp.status_code == 503, resp.text
        assert took < 1.0, took
        assert resp.headers["retry-after"]
        assert resp.json()["error"]["code"] == "not_ready"
        assert httpx.get(f"{url}/readyz", timeout=5).status_code == 503
        deploying.join(timeout=180)
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/readyz", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "ready once every deployment runs"
            time.sleep(0.2)
        resp = httpx.post(
            f"{url}/v1/chat/completions",
            json=body,
            headers={"Authorization": "Bearer alice-key"},
            timeout=60,
        )
        assert resp.status_code == 200, resp.text
    finally:
        deploying.join(timeout=180)
        serve.delete("slow")
