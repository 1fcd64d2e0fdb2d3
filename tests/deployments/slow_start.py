"""A fake engine whose LLM-worker replica takes `options.start_delay_s` to start (readiness
tests: the worker is still loading while the ingress already answers)."""

from __future__ import annotations

import time

from mpic.deployments.engines.fake_engine import FakeServeEngine


class SlowStartEngine(FakeServeEngine):
    """`FakeServeEngine` that sleeps in its constructor in the worker role."""

    def __init__(self, cfg, store, role) -> None:
        super().__init__(cfg, store, role)
        if role == "worker":
            time.sleep(float(cfg.options.get("start_delay_s", 20)))
