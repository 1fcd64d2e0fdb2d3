"""`mpic demo`'s HTTP path (the README's main job) against the session's real Ray Serve app:
its answers equal the offline reference runner's for the same prompt and policy, and it reports
the tokens each policy linked."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deployments.conftest import ServeApp

pytestmark = pytest.mark.slow


def test_http_demo_answers_like_the_offline_engine(serve_app: ServeApp, tiny_llava_dir: Path):
    from mpic.cli.demo_http import run_demo
    from mpic.engine.hf.reference_runner import ReferenceRunner
    from mpic.samples import interleaved_prompt, synthetic_png

    rows = run_demo(serve_app.url, "alice-key", ["full", "mpic-4"], max_tokens=6)

    runner = ReferenceRunner(str(tiny_llava_dir))
    entries = [runner.cache_image(synthetic_png(i)).entry_id for i in range(3)]
    for row in rows:
        gen = runner.generate(interleaved_prompt(entries), row.policy, 6)
        expected = runner.processor.tokenizer.decode(gen.tokens, skip_special_tokens=True)
        assert row.answer == expected, row.policy
        assert row.ttft_s > 0
    assert [r.policy for r in rows] == ["full", "mpic-4"]
    assert [r.cached_tokens for r in rows] == [0, 3 * (16 - 4)]  # 3 images, T=16, k=4
    assert rows[0].prompt_tokens == rows[1].prompt_tokens > 3 * 16
