"""How a vLLM engine is started (process that owns the engine: CLI, benchmark, Serve replica):
the CPU set-up (`prepare_environment`) and vLLM's engine arguments with the MPIC connector
(`engine_kwargs`), shared by the offline and the async engine (`mpic.engine.vllm.frontend
.VllmFrontEnd`). vLLM's engine core and worker (child processes) load the connector
`CONNECTOR_MODULE` and the plugin `mpic.engine.vllm.plugin` themselves.

Every CPU set-up step (docs/design.md "Platform notes") lives in `prepare_environment`:
- `VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache) from `VllmEngineConfig.kv_cache_gib`;
- `VLLM_WORKER_MULTIPROC_METHOD=spawn`: vLLM's children are spawned, never forked from a process
  that already runs torch threads (callers' scripts need `if __name__ == "__main__":`);
- float32 by default (`VllmOptions.dtype`; bfloat16 is faster on a CPU with AMX, slower on
  AVX2-only cores: docs/vllm.md); a float32 start logs a hint on a CPU whose flags have
  `amx_bf16`, and a warning on a CUDA device, where bfloat16 is what `vllm serve` would pick;
- `block_size` a multiple of 32 (the CPU attention kernel's requirement, enforced by the
  config);
- the torchvision shim for CPU torch is NOT here: it must run at interpreter start-up, so
  scripts/setup.sh installs it as a `.pth` (scripts/torchvision_cpu_shim.py documents it).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from mpic.engine.model_dir import resolve_model_dir
from mpic.engine.vllm.config import VllmEngineConfig
from mpic.engine.vllm.version import check_vllm_version

CONNECTOR = "MPICConnector"
CONNECTOR_MODULE = "mpic.engine.vllm.connector.kv_connector"

__all__ = ["CONNECTOR", "CONNECTOR_MODULE", "engine_kwargs", "prepare_environment"]

log = logging.getLogger(__name__)

CPUINFO = Path("/proc/cpuinfo")
"""Where `cpu_flags` reads the CPU's feature flags (Linux)."""


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def cpu_flags() -> set[str]:
    """The CPU's feature flags (`flags` of /proc/cpuinfo: `amx_bf16`, `avx512f`, ...; empty
    where there is no such file)."""
    try:
        for line in CPUINFO.read_text().splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def prepare_environment(cfg: VllmEngineConfig) -> None:
    """Check the installed vLLM's release (`mpic.engine.vllm.version`: stops outside the tested
    range unless overridden) and set the process environment vLLM reads at start-up (see the
    module docstring)."""
    check_vllm_version(cfg.allow_untested_vllm)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gib)
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if cfg.dtype == "float32" and _cuda_available():
        log.warning(
            "engine.dtype float32 on a CUDA device: twice the memory of bfloat16 and slower "
            "(vllm serve's --dtype auto serves a bfloat16 checkpoint in bfloat16); set "
            "engine.dtype: bfloat16 (mpic serve --dtype bfloat16)"
        )
    elif cfg.dtype == "float32" and "amx_bf16" in cpu_flags():
        log.info(
            "this CPU has AMX bfloat16 tiles: engine.dtype bfloat16 (mpic serve --dtype "
            "bfloat16) serves 2-3x the requests of float32 here; float32 is the default, the "
            "dtype the exactness checks compare"
        )


def engine_kwargs(cfg: VllmEngineConfig) -> dict[str, Any]:
    """vLLM `EngineArgs` keywords for `cfg` (the offline `LLM` and `AsyncEngineArgs` take the
    same): the MPIC connector (`kv_load_failure_policy="fail"`: a failed link errors the request,
    the caller answers it exactly) and the CPU-friendly settings."""
    from vllm.config import KVTransferConfig

    kv_transfer = None
    if cfg.linking:
        kv_transfer = KVTransferConfig(
            kv_connector=CONNECTOR,
            kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_both",
            kv_load_failure_policy="fail",
            kv_connector_extra_config={
                "storage": cfg.storage.model_dump(mode="json"),
                "async_loads": cfg.async_loads,
                "batch_links": cfg.batch_links,
                "link_share": cfg.link_share,
                "link_prefix": cfg.link_prefix,
            },
        )
    optional = {
        "num_gpu_blocks_override": cfg.num_blocks,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
    }
    return dict(
        model=resolve_model_dir(cfg.model),  # a local folder, or the local copy of an S3 prefix
        dtype=cfg.dtype,
        block_size=cfg.block_size,
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        enable_prefix_caching=cfg.enable_prefix_caching,
        enforce_eager=cfg.enforce_eager,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        tensor_parallel_size=cfg.tensor_parallel_size,
        seed=cfg.seed,
        kv_transfer_config=kv_transfer,
        limit_mm_per_prompt={"image": 16},
        disable_log_stats=not cfg.log_stats,
        max_logprobs=cfg.max_logprobs,
        **{k: v for k, v in optional.items() if v is not None},
    )
