"""The live fidelity monitor on the vLLM worker (in-process app, no Ray; tiny LLaVA): vLLM
returns logprobs, not logits, so a sampled request's served pass returns its top-20 raw
logprobs and the shadow exact pass the logprobs of exactly those token ids. The sampled `topk`
KL (both distributions renormalised over the served top-20) and the top-1 agreement equal the
same quantities computed from the offline reference runner's full logits (exact prefill vs the
policy's, same prompt)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.deployments.conftest import ADMIN_KEY, KEYS, png
from tests.deployments.inprocess import fake_config, in_process_app

pytestmark = pytest.mark.slow

HEADERS = {"Authorization": "Bearer alice-key"}


def test_vllm_topk_kl_equals_the_reference_engines(tiny_llava_dir: Path, tmp_path: Path) -> None:
    import torch

    from mpic.deployments.config import FidelityConfig
    from mpic.engine.answers import token_agreement
    from mpic.engine.hf.reference_runner import ReferenceRunner
    from mpic.prompt_parts import ImageRef

    cfg = fake_config(tmp_path / "store", kind="vllm", model=str(tiny_llava_dir))
    cfg = cfg.model_copy(update={"fidelity": FidelityConfig(sample_rate=1.0)})
    offline = ReferenceRunner(str(tiny_llava_dir))
    media = [png(81), png(82)]
    with in_process_app(cfg, KEYS, [ADMIN_KEY]) as app:
        fids = []
        for i, m in enumerate(media):
            up = app.client.post(
                "/v1/files",
                headers=HEADERS,
                files={"file": (f"{i}.png", m, "image/png")},
                data={"purpose": "vision"},
            )
            assert up.status_code == 200, up.text
            fids.append(up.json()["id"])
        content = [
            {"type": "text", "text": "first"},
            {"type": "file", "file": {"file_id": fids[0]}},
            {"type": "text", "text": "second"},
            {"type": "file", "file": {"file_id": fids[1]}},
            {"type": "text", "text": "differences?"},
        ]
        body = {
            "model": "mpic",
            "max_tokens": 3,
            "logprobs": True,
            "top_logprobs": 2,  # the client's own logprobs stay as asked
            "mpic": {"policy": "full-reuse"},
            "messages": [{"role": "user", "content": content}],
        }
        resp = app.client.post(
            "/v1/chat/completions", headers={**HEADERS, "X-Request-ID": "v-1"}, json=body
        )
        assert resp.status_code == 200, resp.text
        lp = resp.json()["choices"][0]["logprobs"]["content"]
        assert all(len(t["top_logprobs"]) == 2 for t in lp)
        deadline = time.monotonic() + 300
        while not app.worker.fidelity.samples and time.monotonic() < deadline:
            time.sleep(0.1)
        stats = app.worker.fidelity_stats()
        assert app.worker.fidelity.samples, stats
        sample = app.worker.fidelity.samples[-1]
    refs = [ImageRef(offline.cache_image(m).entry_id) for m in media]
    parts = ["first", refs[0], "second", refs[1], "differences?"]
    full = offline.prefill(parts, "full").logits.double()
    served = offline.prefill(parts, "full-reuse").logits.double()
    ids = sample.token_ids
    assert sample.kind == "topk" and sample.request_id == "v-1" and len(ids) == 20
    assert set(ids) == set(served.topk(20).indices.tolist())  # vLLM's top-20 = the reference's
    p = torch.log_softmax(full[ids], -1)
    q = torch.log_softmax(served[ids], -1)
    want = float((p.exp() * (p - q)).sum())
    print(f"vLLM sampled top-20 KL {sample.kl:.6g}, reference {want:.6g}; stats {stats}")
    assert abs(sample.kl - want) < 1e-3 and want > 0
    assert sample.top1_agree == (int(full.argmax()) == int(served.argmax()))
    # the answer (greedy, 3 tokens): vLLM's served and exact answers as the reference's
    exact_answer = offline.generate(parts, "full", 3).tokens
    served_answer = offline.generate(parts, "full-reuse", 3).tokens
    want_answer = token_agreement(served_answer, exact_answer, 3, None)
    assert sample.answer_agreement == pytest.approx(want_answer)
