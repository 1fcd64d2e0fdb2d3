"""vLLM general plugin: how the MPIC connector reaches the model (runs in EVERY vLLM process).

vLLM gives a KV connector its KV caches but not the model, and its ways to run a function in the
worker (`collective_rpc` / `apply_model` with a callable) need
`VLLM_ALLOW_INSECURE_SERIALIZATION=1`. So the `mpic` entry point of `vllm.general_plugins`
(pyproject.toml), which vLLM calls in every process before the worker is built
(`v1/worker/worker_base.py`), wraps the model runner's `initialize_kv_cache` (`CPUModelRunner`
on CPU, `GPUModelRunner` on GPU): vLLM runs it right after it built the KV connector
(`ensure_kv_transfer_initialized`), so the wrapper hands the runner itself to the MPIC connector's
worker half through vLLM's own accessor `get_kv_transfer_group()`. No module global holds the
runner; nothing in vLLM is edited.

It also gives the worker class a method `mpic_connector_stats` so the engine's owner can read the
worker half's linking counters with `collective_rpc("mpic_connector_stats")` (a method name
travels without pickling).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

logger = logging.getLogger(__name__)

_PATCHED: set[str] = set()
"""Classes already wrapped in this process (`register` is idempotent)."""


def _connector_worker_half() -> Any:
    """The MPIC connector's worker half of this process, or None (no or another connector)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    half = getattr(get_kv_transfer_group(), "worker", None)
    return half if hasattr(half, "attach_runner") else None


def _wrap_runner(cls: type) -> None:
    key = f"{cls.__module__}.{cls.__qualname__}"
    if key in _PATCHED:
        return
    original = cls.initialize_kv_cache

    @functools.wraps(original)
    def initialize_kv_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        half = _connector_worker_half()
        if half is not None:
            half.attach_runner(self)
            logger.info("MPIC plugin: %s handed to the KV connector", type(self).__name__)
        return result

    cls.initialize_kv_cache = initialize_kv_cache
    _PATCHED.add(key)


def _stats_method(cls: type) -> None:
    def mpic_connector_stats(self: Any) -> dict[str, int]:
        """The MPIC connector worker half's counters ({} without that connector)."""
        half = _connector_worker_half()
        return dict(half.stats) if half is not None else {}

    cls.mpic_connector_stats = mpic_connector_stats


def register() -> None:
    """Entry point: wrap the model runners that exist in this vLLM build (idempotent)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
        from vllm.v1.worker.cpu_worker import CPUWorker

        _wrap_runner(CPUModelRunner)
        _stats_method(CPUWorker)
    else:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        from vllm.v1.worker.gpu_worker import Worker

        _wrap_runner(GPUModelRunner)
        _stats_method(Worker)
