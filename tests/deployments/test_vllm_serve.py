"""The LLM worker on vLLM + the MPIC connector (`engine.kind: vllm`), as a second Serve
application on the session's Ray instance: uploads are cached by vLLM's own forward and linked
answers equal the offline reference runner's for the same prompt and policy."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.deployments.conftest import ServeApp, png, serve_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_url(serve_app: ServeApp, tiny_llava_dir: Path, tmp_path_factory) -> Iterator[str]:
    from ray import serve

    from mpic.deployments.app import build_app
    from mpic.deployments.local import prepare_local, wait_healthy

    cfg = serve_config(tiny_llava_dir, tmp_path_factory.mktemp("vllm-store"))
    one = cfg.llm_worker.model_copy(update={"autoscaling": cfg.encoder.autoscaling})
    cfg = cfg.model_copy(
        update={
            "name": "mpic-vllm",
            "route_prefix": "/vllm",
            "llm_worker": one,
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


def test_vllm_worker_answers_like_the_reference_runner(vllm_url: str, tiny_llava_dir) -> None:
    from mpic.engine.reference_runner import ReferenceRunner
    from mpic.linker.prompt import ImageRef

    headers = {"Authorization": "Bearer alice-key"}
    images = [png(61), png(62)]
    ids = []
    for data in images:
        resp = httpx.post(
            f"{vllm_url}/v1/files",
            headers=headers,
            timeout=300,
            files={"file": ("v.png", data, "image/png")},
            data={"purpose": "vision"},
        )
        assert resp.status_code == 200, resp.text
        ids.append(resp.json()["id"])
    content = [
        {"type": "text", "text": "first"},
        {"type": "file", "file": {"file_id": ids[0]}},
        {"type": "text", "text": "then"},
        {"type": "file", "file": {"file_id": ids[1]}},
        {"type": "text", "text": "why?"},
    ]
    runner = ReferenceRunner(str(tiny_llava_dir))
    entries = [runner.cache_image(d).entry_id for d in images]
    parts = ["first", ImageRef(entries[0]), "then", ImageRef(entries[1]), "why?"]
    for policy, linked in [("full", 0), ("mpic-4", 2 * (16 - 4))]:
        body = {
            "model": "m",
            "max_tokens": 6,
            "mpic": {"policy": policy},
            "messages": [{"role": "user", "content": content}],
        }
        resp = httpx.post(
            f"{vllm_url}/v1/chat/completions", headers=headers, json=body, timeout=300
        )
        assert resp.status_code == 200, resp.text
        gen = runner.generate(parts, policy, 6)
        expected = runner.processor.tokenizer.decode(gen.tokens, skip_special_tokens=True)
        assert resp.json()["choices"][0]["message"]["content"] == expected, policy
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == linked
