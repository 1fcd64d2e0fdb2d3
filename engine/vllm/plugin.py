"""vLLM general plugin: how the MPIC connector reaches the model (runs in EVERY vLLM process).

vLLM calls `register()` (entry point `vllm.general_plugins: mpic`, pyproject.toml) in every
process before the worker is built (`v1/worker/worker_base.py`). We wrap the model runner's
`load_model` (`CPUModelRunner` on CPU, `GPUModelRunner` on GPU) so that, once the model is loaded
in the worker process, the runner is recorded here; the connector's worker side
(`mpic.engine.vllm.connector`) picks it up with `current_runner()` to run the selective prefill
with vLLM's own modules. Nothing in vLLM is edited; outside a worker `current_runner()` is None.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

logger = logging.getLogger(__name__)

_RUNNER: Any = None
_PATCHED: set[str] = set()


def current_runner() -> Any:
    """The model runner of this worker process (None before `load_model` or outside a worker)."""
    return _RUNNER


def _wrap(cls: type) -> None:
    key = f"{cls.__module__}.{cls.__qualname__}"
    if key in _PATCHED:
        return
    original = cls.load_model

    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _RUNNER
        result = original(self, *args, **kwargs)
        _RUNNER = self
        logger.info("MPIC plugin: recorded %s for the KV connector", type(self).__name__)
        return result

    cls.load_model = load_model
    _PATCHED.add(key)


def register() -> None:
    """Entry point: wrap the model runners that exist in this vLLM build (idempotent)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        _wrap(CPUModelRunner)
    else:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        _wrap(GPUModelRunner)
