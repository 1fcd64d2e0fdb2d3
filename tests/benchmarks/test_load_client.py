"""`mpic bench load`'s closed loop waits after a refusal as OpenAI's Python client does (issue 35
item 5): the wait the refusal announces (`retry-after-ms` first, then `Retry-After`), else an
exponential backoff; `--retry fixed` keeps the earlier 0.2 s. Against an in-memory transport
(no server), so the timing is the client's own."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest


def test_retry_delay_reads_the_announced_wait_as_openai_does() -> None:
    from mpic.benchmarks.load.bench import retry_delay_s
    from mpic.benchmarks.load.requests import announced_wait_s

    both = httpx.Headers({"retry-after": "2", "retry-after-ms": "1250"})
    assert announced_wait_s(both) == 1.25  # milliseconds first
    assert announced_wait_s(httpx.Headers({"retry-after": "3"})) == 3.0
    assert announced_wait_s(httpx.Headers({"retry-after": "0.5"})) == 0.5  # as openai: floats
    assert announced_wait_s(httpx.Headers({"retry-after": "soon"})) is None
    assert retry_delay_s("openai", both, 0) == 1.25
    assert retry_delay_s("openai", httpx.Headers({"retry-after": "3"}), 5) == 3.0
    # none announced (or out of (0, 120] s): 0.5 s doubling per refusal in a row, at most 8 s,
    # less up to 25 % jitter
    rng = random.Random(0)
    for attempt, top in [(0, 0.5), (1, 1.0), (3, 4.0), (4, 8.0), (9, 8.0)]:
        for headers in ({}, {"retry-after": "0"}, {"retry-after": "600"}):
            wait = retry_delay_s("openai", httpx.Headers(headers), attempt, rng)
            assert 0.75 * top <= wait <= top
    # the earlier behaviours, kept for the earlier tables
    assert retry_delay_s("fixed", both, 3) == 0.2
    assert retry_delay_s("retry-after", both, 0) == 2.0  # the integer header only
    assert retry_delay_s("retry-after", httpx.Headers({}), 0) == 0.2
    with pytest.raises(ValueError):
        retry_delay_s("eager", both, 0)


def _sse_ok() -> bytes:
    chunk = {"choices": [{"delta": {"content": "hi"}}]}
    usage = {"choices": [], "usage": {"completion_tokens": 1}}
    return f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()


def _server(refusals: int, headers: dict[str, str], arrivals: list[float]):
    """An in-memory chat route: the first `refusals` requests get a JSON 429 with `headers`,
    the rest a one-chunk stream; `arrivals` gets each request's time."""

    def handle(request: httpx.Request) -> httpx.Response:
        arrivals.append(time.perf_counter())
        if len(arrivals) <= refusals:
            body = {
                "error": {"message": "busy", "type": "rate_limit_error", "param": None, "code": "x"}
            }
            return httpx.Response(429, json=body, headers=headers)
        return httpx.Response(200, content=_sse_ok(), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handle)


async def _closed_loop(transport: httpx.MockTransport, retry: str | None, duration_s: float):
    from mpic.benchmarks.load import bench
    from mpic.benchmarks.load.report import LoadResult

    out = LoadResult(1, duration_s, 0, 0, 0.0, 0.0, 0, 0.0, 0.0)
    kwargs = {} if retry is None else {"retry": retry}
    async with httpx.AsyncClient(base_url="http://load", transport=transport) as http:
        t0 = time.perf_counter()
        await bench._client(0, http, [], "mpic-4", 1, t0, t0 + duration_s, out, [], **kwargs)
    return out


def test_closed_loop_client_waits_the_announced_time_by_default() -> None:
    """By default a refused client waits what the refusal announces (here 0.6 s in
    `retry-after-ms`, 2 s in `Retry-After`) before its next try; `--retry fixed` retries after
    0.2 s whatever is announced."""
    import inspect

    from mpic.benchmarks.load import bench

    assert inspect.signature(bench.run_load_async).parameters["retry"].default == "openai"
    assert inspect.signature(bench._client).parameters["retry"].default == "openai"

    announced = {"retry-after": "1", "retry-after-ms": "600"}
    arrivals: list[float] = []
    out = asyncio.run(_closed_loop(_server(2, announced, arrivals), None, 1.6))
    assert out.rejected == 2 and out.requests >= 1 and out.errors == 0
    gaps = [b - a for a, b in zip(arrivals[:-1], arrivals[1:], strict=True)]
    assert 0.55 <= gaps[0] < 0.95 and 0.55 <= gaps[1] < 0.95, gaps  # 0.6 s each, not 0.2 s

    arrivals = []
    out = asyncio.run(_closed_loop(_server(2, announced, arrivals), "fixed", 0.8))
    assert out.rejected == 2 and out.requests >= 1
    gaps = [b - a for a, b in zip(arrivals[:-1], arrivals[1:], strict=True)]
    assert 0.15 <= gaps[0] < 0.5 and 0.15 <= gaps[1] < 0.5, gaps


def test_load_result_reports_goodput_and_refusals_per_second(tmp_path) -> None:
    from mpic.benchmarks.load.report import LoadResult, write_outputs

    res = LoadResult(64, 30.0, 240, 0, 1.5, 2.9, 240, 8.0, 8.0, retry="openai")
    res.rejected, res.rejected_per_s, res.rejected_by_status = 720, 24.0, {"429": 720}
    res.retry_after_p50_s, res.retry_after_max_s = 1.4, 2.0
    write_outputs(res, str(tmp_path / "load.json"), None)
    saved = json.loads((tmp_path / "load.json").read_text())
    assert saved["requests_per_s"] == 8.0 and saved["rejected_per_s"] == 24.0
    assert saved["retry"] == "openai" and saved["retry_after_p50_s"] == 1.4
