"""One request of `mpic bench load` (CLI process) and how its answer is classified: admitted
(200, TTFT to the first SSE content chunk, output tokens from the usage chunk), rejected (429/503:
the admission control; its `Retry-After`, the wait it announces as OpenAI's client reads it
(`announced_wait_s`), whether the body is OpenAI-style JSON and its `error.code` are recorded)
or an error. Also the server's own count of the rejections
(`mpic_requests_total` of the chat route on /metrics), to compare with what the clients saw.
"""

from __future__ import annotations

import json
import time

import httpx

from mpic.benchmarks.chat_client import sse_chunk
from mpic.benchmarks.load.report import LoadResult


class _Rejected(Exception):
    def __init__(self, status: int, headers: httpx.Headers) -> None:
        super().__init__(f"HTTP {status}")
        self.status, self.headers = status, headers


def announced_wait_s(headers: httpx.Headers) -> float | None:
    """The wait a refusal announces, read as OpenAI's Python client reads it
    (`_parse_retry_after_header`): `retry-after-ms` first, then `Retry-After` as (possibly
    fractional) seconds; None when neither is a number (an HTTP date is not sent here)."""
    for name, divisor in (("retry-after-ms", 1000), ("retry-after", 1)):
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            return float(raw) / divisor
        except ValueError:
            continue
    return None


async def send_one(
    http: httpx.AsyncClient,
    body: dict,
    t_start: float,
    out: LoadResult,
    rejected_lat: list,
    announced: list | None = None,
) -> httpx.Headers | None:
    """One streaming request, classified as admitted, rejected (429/503) or an error; the
    headers of a rejection (None otherwise). `announced` collects each rejection's announced
    wait (s; `announced_wait_s`)."""
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    out.sent += 1
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code in (429, 503):
                raw = await resp.aread()
                out.rejected_not_json += not _is_json_error(resp.headers, raw)
                code = _error_code(raw)
                out.rejected_by_code[code] = out.rejected_by_code.get(code, 0) + 1
                raise _Rejected(resp.status_code, resp.headers)
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
            async for line in resp.aiter_lines():
                chunk = sse_chunk(line)
                if chunk is None:
                    continue
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error'].get('code')}")
                if (
                    ttft is None
                    and chunk["choices"]
                    and chunk["choices"][0]["delta"].get("content")
                ):
                    ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        if ttft is None:
            raise RuntimeError("stream ended without content")
        out.requests += 1
        out.output_tokens += tokens
        out.samples.append((t0 - t_start, ttft))
    except _Rejected as rej:
        out.rejected += 1
        key = str(rej.status)
        out.rejected_by_status[key] = out.rejected_by_status.get(key, 0) + 1
        out.rejected_without_retry_after += rej.headers.get("retry-after") is None
        rejected_lat.append(time.perf_counter() - t0)
        if announced is not None and (wait := announced_wait_s(rej.headers)) is not None:
            announced.append(wait)
        return rej.headers
    except (httpx.HTTPError, RuntimeError, json.JSONDecodeError, KeyError) as exc:
        out.errors += 1
        if len(out.error_samples) < 5:
            out.error_samples.append(f"{type(exc).__name__}: {exc}")


def _is_json_error(headers: httpx.Headers, raw: bytes) -> bool:
    """True for an OpenAI-style JSON error body."""
    if not headers.get("content-type", "").startswith("application/json"):
        return False
    try:
        return set(json.loads(raw)["error"]) >= {"message", "type", "code"}
    except (ValueError, KeyError, TypeError):
        return False


def _error_code(raw: bytes) -> str:
    """`error.code` of a JSON error body ("?" when there is none)."""
    try:
        return str(json.loads(raw)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "?"


_REQUEST_SERIES = ("mpic_requests_total", "ray_mpic_requests_total")
"""The ingress's request counter as Ray's metrics agent exports it (with or without `ray_`)."""


def rejections_in_metrics(text: str) -> dict[str, float]:
    """`mpic_requests_total` of the chat route by rejection outcome (429, 503) in a Prometheus
    text, summed over replicas and nodes."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name not in _REQUEST_SERIES or "/v1/chat/completions" not in line:
            continue
        for status in ("429", "503"):
            if f'outcome="{status}"' in line:
                out[status] = out.get(status, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def metrics_rejections(http: httpx.AsyncClient) -> dict[str, float]:
    try:
        return rejections_in_metrics((await http.get("/metrics")).text)
    except httpx.HTTPError:
        return {}


_TTFT_SERIES = (
    "vllm:time_to_first_token_seconds_bucket",
    "ray_vllm_time_to_first_token_seconds_bucket",
)
"""The ingress's own TTFT histogram (request received by the chat route -> first token sent)."""


def ttft_buckets_in_metrics(text: str) -> dict[float, float]:
    """The server's TTFT histogram in a Prometheus text: upper bound (s) -> cumulative count,
    summed over replicas and models (`+Inf` is the count)."""
    out: dict[float, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name not in _TTFT_SERIES or 'le="' not in line:
            continue
        le = float(line.split('le="', 1)[1].split('"', 1)[0])
        out[le] = out.get(le, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def metrics_ttft(http: httpx.AsyncClient) -> dict[float, float]:
    try:
        return ttft_buckets_in_metrics((await http.get("/metrics")).text)
    except httpx.HTTPError:
        return {}
