"""The LLM worker on vLLM + the MPIC connector (`engine.kind: vllm`, vLLM V1's `AsyncLLM`), as a
second Serve application on the session's Ray instance, sharing the session app's store (files
uploaded through the reference app are unseen by this app's memory tiers): uploads are cached by
vLLM's own forward, linked answers equal the offline reference runner's, concurrent streams are
batched by vLLM's scheduler and arrive token by token, and a lost entry still gets the exact
answer (recomputed by the worker, or by vLLM's exact fallback when only vLLM cannot load it)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from tests.deployments.conftest import ServeApp, png, serve_config, upload

pytestmark = pytest.mark.slow

ALICE = {"Authorization": "Bearer alice-key"}
APP = "mpic-vllm"


@pytest.fixture(scope="module")
def vllm_url(serve_app: ServeApp, tiny_llava_dir: Path, tmp_path_factory) -> Iterator[str]:
    from ray import serve

    from mpic.deployments.app import build_app
    from mpic.deployments.local import prepare_local, wait_healthy

    cfg = serve_config(tiny_llava_dir, tmp_path_factory.mktemp("unused"))
    one = cfg.llm_worker.model_copy(update={"autoscaling": cfg.encoder.autoscaling})
    cfg = cfg.model_copy(
        update={
            "name": APP,
            "route_prefix": "/vllm",
            "llm_worker": one,
            "store": serve_app.config.store,
            "engine": cfg.engine.model_copy(update={"kind": "vllm"}),
        }
    )
    serve.run(build_app(prepare_local(cfg)), name=cfg.name, route_prefix=cfg.route_prefix)
    url = f"{serve_app.url}/vllm"
    wait_healthy(url, 300)
    try:
        yield url
    finally:
        serve.delete(cfg.name)


@pytest.fixture(scope="module")
def runner(tiny_llava_dir: Path):
    from mpic.engine.hf.reference_runner import ReferenceRunner

    return ReferenceRunner(str(tiny_llava_dir))


def _expected(runner, media: list[bytes], texts: list[str], policy: str, n: int) -> str:
    """The reference runner's answer to texts[0], image 0, texts[1], image 1, ... ."""
    from mpic.linker.prompt import ImageRef

    parts: list = []
    for i, text in enumerate(texts):
        parts.append(text)
        if i < len(media):
            parts.append(ImageRef(runner.cache_image(media[i]).entry_id))
    gen = runner.generate(parts, policy, n, stop_at_eos=False)
    return runner.processor.tokenizer.decode(gen.tokens, skip_special_tokens=True)


def _content(texts: list[str], file_ids: list[str]) -> list[dict]:
    out: list[dict] = []
    for i, text in enumerate(texts):
        out.append({"type": "text", "text": text})
        if i < len(file_ids):
            out.append({"type": "file", "file": {"file_id": file_ids[i]}})
    return out


def _chat(url: str, content: list, policy: str, max_tokens: int = 6) -> dict:
    body = {
        "model": "mpic",
        "max_tokens": max_tokens,
        "mpic": {"policy": policy},
        "messages": [{"role": "user", "content": content}],
    }
    resp = httpx.post(f"{url}/v1/chat/completions", headers=ALICE, json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _stats() -> dict[str, int]:
    from ray import serve

    handle = serve.get_deployment_handle("LLMWorker", app_name=APP)
    return handle.engine_stats.remote().result()


@pytest.fixture(scope="module")
def files(vllm_url: str) -> tuple[list[bytes], list[str]]:
    media = [png(61), png(62)]
    ids = []
    for data in media:
        resp = httpx.post(
            f"{vllm_url}/v1/files",
            headers=ALICE,
            timeout=300,
            files={"file": ("v.png", data, "image/png")},
            data={"purpose": "vision"},
        )
        assert resp.status_code == 200, resp.text
        ids.append(resp.json()["id"])
    return media, ids


def test_vllm_worker_answers_like_the_reference_runner(vllm_url, files, runner) -> None:
    media, ids = files
    texts = ["first", "then", "why?"]
    for policy, linked in [("full", 0), ("mpic-4", 2 * (16 - 4))]:
        got = _chat(vllm_url, _content(texts, ids), policy)
        assert got["choices"][0]["message"]["content"] == _expected(
            runner, media, texts, policy, 6
        ), policy
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == linked


async def _stream(client: httpx.AsyncClient, url: str, content: list, policy: str, n: int):
    """(text, arrival times of content chunks, end time) of one SSE chat stream."""
    body = {
        "model": "mpic",
        "max_tokens": n,
        "stream": True,
        "mpic": {"policy": policy},
        "messages": [{"role": "user", "content": content}],
    }
    pieces, times = [], []
    async with client.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers=ALICE, timeout=300
    ) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:])["choices"]
            if choices and choices[0]["delta"].get("content"):
                pieces.append(choices[0]["delta"]["content"])
                times.append(time.perf_counter())
    return "".join(pieces), times, time.perf_counter()


def test_policies_checked_at_the_resolver_on_the_vllm_app(vllm_url) -> None:
    """The vLLM app's Resolver checks the policy against the layer count `build_app` read from
    the tiny LLaVA's config.json (2 layers), without asking the vLLM worker: 400 on
    `mpic.policy` for an unknown name or three VLCache ratios, 200 for two."""
    text = [{"type": "text", "text": "hi"}]
    for policy in ("magic", "vlcache-0.5:0.4:0.3"):
        body = {
            "model": "mpic",
            "mpic": {"policy": policy},
            "messages": [{"role": "user", "content": text}],
        }
        resp = httpx.post(f"{vllm_url}/v1/chat/completions", headers=ALICE, json=body, timeout=60)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "mpic.policy", resp.text
    assert _chat(vllm_url, text, "vlcache-0.5:0.4", max_tokens=2)["mpic"]["policy"]


def test_concurrent_streams_are_batched_exact_and_incremental(vllm_url, files, runner) -> None:
    media, ids = files
    n = 24
    cases = [  # (texts, files used, policy); the last one is plain text
        (["a", "b", "c?"], 2, "full"),
        (["first", "then", "why?"], 2, "mpic-4"),
        (["look at", "now"], 1, "mpic-4"),
        (["compare", "and", "ok"], 2, "cacheblend-15"),
        (["only", "this"], 1, "full-reuse"),
        (["no image here, just text"], 0, "mpic-4"),
    ]

    async def run_all():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(
                *[_stream(client, vllm_url, _content(t, ids[:k]), p, n) for t, k, p in cases]
            )

    before = _stats()["peak_running"]
    outs = asyncio.run(run_all())
    for (texts, k, policy), (text, times, end) in zip(cases, outs, strict=True):
        assert text == _expected(runner, media[:k], texts, policy, n), policy
        assert len(times) > 1, "tokens arrive as several SSE chunks"
        assert times[-1] - times[0] > 0.005 and end > times[0], "first chunk before the last"
    peak = _stats()["peak_running"]
    assert peak >= 2 and peak >= before, "vLLM's scheduler ran concurrent requests together"


def _blob(serve_app: ServeApp, entry_id: str) -> Path:
    return Path(urlparse(serve_app.config.store.url).path) / "entries" / entry_id


def test_lost_entries_still_get_the_exact_answer(vllm_url, serve_app, runner) -> None:
    # Files uploaded through the reference app: this app's processes have never loaded them.
    media = [png(71), png(72)]
    ids = []
    for data in media:
        resp = upload(serve_app, "alice-key", data)
        assert resp.status_code == 200, resp.text
        ids.append(resp.json()["id"])
    entry = [runner.cache_image(m).entry_id for m in media]
    texts = ["see", "well?"]
    # Corrupt in the store: the worker's load fails and it recomputes the entry through vLLM.
    blob = _blob(serve_app, entry[0])
    blob.write_bytes(b"not an entry" + blob.read_bytes()[12:])
    got = _chat(vllm_url, _content(texts, ids[:1]), "mpic-4")
    assert got["mpic"]["fallbacks"] == 1
    assert got["choices"][0]["message"]["content"] == _expected(
        runner, media[:1], texts, "mpic-4", 6
    )
    # Loaded by the worker only (a request refused after the load: too long), then deleted:
    # vLLM's worker cannot link it, the request is answered exactly (like `full`).
    body = {
        "model": "mpic",
        "max_tokens": 4096,
        "messages": [{"role": "user", "content": _content(texts, ids[1:])}],
    }
    refused = httpx.post(f"{vllm_url}/v1/chat/completions", headers=ALICE, json=body, timeout=300)
    assert refused.status_code == 400, refused.text
    _blob(serve_app, entry[1]).unlink()
    before = _stats()["fallbacks"]
    got = _chat(vllm_url, _content(texts, ids[1:]), "mpic-4")
    assert _stats()["fallbacks"] == before + 1
    assert got["mpic"]["fallbacks"] == 1 and got["mpic"]["tier_hits"] == {"memory": 1}
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert got["choices"][0]["message"]["content"] == _expected(runner, media[1:], texts, "full", 6)


def test_press_on_vllm_worker_links_compressed_images(vllm_url, files, runner) -> None:
    """`mpic.press` on the vLLM worker (issue 15 item 4): the images are linked as compressed
    entries made by vLLM's worker; the answer equals the reference runner's same uniform
    variant, and the prompt is shorter by (T - C) tokens per image."""
    from mpic.linker.prompt import ImageRef
    from mpic.presses.base import keep_count

    media, ids = files
    texts = ["first", "then", "why?"]
    body = {
        "model": "mpic",
        "max_tokens": 6,
        "mpic": {"policy": "mpic-4", "press": "elastic", "budget": 0.3},
        "messages": [{"role": "user", "content": _content(texts, ids)}],
    }
    resp = httpx.post(f"{vllm_url}/v1/chat/completions", headers=ALICE, json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    got = resp.json()
    pressed = [runner.press_entry(runner.cache_image(m), "elastic", 0.3) for m in media]
    parts = [texts[0], ImageRef(pressed[0].entry_id), texts[1], ImageRef(pressed[1].entry_id)]
    gen = runner.generate([*parts, texts[2]], "mpic-4", 6, stop_at_eos=False)
    want = runner.processor.tokenizer.decode(gen.tokens, skip_special_tokens=True)
    assert got["choices"][0]["message"]["content"] == want
    plain = _chat(vllm_url, _content(texts, ids), "mpic-4")
    saved = 2 * (16 - keep_count(0.3, 16))
    assert got["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] - saved
    assert got["usage"]["prompt_tokens"] == gen.prefilled.plan.num_tokens
    # no image: vLLM would compress nothing, so the press is refused, not ignored
    body["messages"] = [{"role": "user", "content": "no image here"}]
    resp = httpx.post(f"{vllm_url}/v1/chat/completions", headers=ALICE, json=body, timeout=300)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "mpic.press"


def test_text_files_and_an_image_on_the_vllm_worker(vllm_url, serve_app, files, runner) -> None:
    """Issue 11 on the vLLM worker: two uploaded text files (purpose user_data, their entries
    computed by vLLM's own forward) and an image in one chat answer as the offline reference
    runner; a corrupt document entry is recomputed by the worker through vLLM."""
    from mpic.prompt_parts import DocumentRef, ImageRef

    notes = ("red squares sit left of\nthe blue circles", "# Shopping\n- two apples\n- bread")
    doc_ids = []
    for text, name in zip(notes, ("notes.txt", "list.md"), strict=True):
        resp = httpx.post(
            f"{vllm_url}/v1/files",
            headers=ALICE,
            timeout=300,
            files={"file": (name, text.encode(), "text/plain")},
            data={"purpose": "user_data"},
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["tokens"] == len(runner.cache_document(text).extra["token_ids"])
        doc_ids.append(resp.json()["id"])
    media, ids = files
    content = _content(["read", "look", "and", "what now?"], [doc_ids[0], ids[0], doc_ids[1]])
    e1, e2 = (runner.cache_document(t).entry_id for t in notes)
    ei = runner.cache_image(media[0]).entry_id
    parts = ["read", DocumentRef(e1), "look", ImageRef(ei), "and", DocumentRef(e2), "what now?"]
    for policy in ("full", "mpic-4", "boundary-2"):
        got = _chat(vllm_url, content, policy)
        gen = runner.generate(parts, policy, 6, stop_at_eos=False)
        want = runner.processor.tokenizer.decode(gen.tokens, skip_special_tokens=True)
        assert got["choices"][0]["message"]["content"] == want, policy
        assert got["usage"]["prompt_tokens"] == gen.prefilled.plan.num_tokens
    # A document uploaded through the reference app (never loaded here), then corrupted.
    text = "a third note\nabout nothing"
    resp = upload(serve_app, "alice-key", text.encode(), "third.txt", purpose="user_data")
    assert resp.status_code == 200, resp.text
    entry_id = runner.cache_document(text).entry_id
    blob = _blob(serve_app, entry_id)
    blob.write_bytes(b"not an entry" + blob.read_bytes()[12:])
    got = _chat(vllm_url, _content(["see", "well?"], [resp.json()["id"]]), "mpic-4")
    assert got["mpic"]["fallbacks"] == 1
    gen = runner.generate(["see", DocumentRef(entry_id), "well?"], "mpic-4", 6, stop_at_eos=False)
    want = runner.processor.tokenizer.decode(gen.tokens, skip_special_tokens=True)
    assert got["choices"][0]["message"]["content"] == want
