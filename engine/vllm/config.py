"""How vLLM is started for MPIC (any process that reads a config: CLI, Serve controller, Serve
replica, benchmark); pydantic only, so a config loads without importing vLLM.

`VllmOptions` holds vLLM's own engine settings (vLLM's names: `dtype`, `block_size`,
`max_model_len`, `max_num_seqs`, `gpu_memory_utilization`, `tensor_parallel_size`, ...): the
serving config's vLLM engine (`mpic.deployments.config.VllmServeEngineConfig`) embeds it as is,
and `VllmEngineConfig` adds what one engine instance needs beside it (the model folder and the
entry store its connector reads). The defaults live here once.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mpic.storage.config import StorageConfig

DTYPES = {
    "auto": "float32",
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}
"""vLLM's `--dtype` choices -> the weights dtype (`mpic serve --dtype`, `mpic bench online
--dtype`; auto: float32, MPIC's default)."""


class VllmOptions(BaseModel):
    """vLLM's engine settings (each one an `EngineArgs` field of the same name, except
    `kv_cache_gib`, `num_blocks` and `allow_untested_vllm`)."""

    model_config = ConfigDict(extra="forbid")

    dtype: str = Field(
        "float32",
        description="Model dtype (float32: what the exactness checks compare; bfloat16 is faster "
        "on CPUs with AMX, ~5x slower on AVX2-only cores).",
    )
    block_size: int = Field(32, description="KV block size; a multiple of 32 on CPU.")
    kv_cache_gib: int = Field(1, ge=1, description="CPU KV cache size (VLLM_CPU_KVCACHE_SPACE).")
    max_model_len: int | None = Field(None, ge=1, description="Context limit (None: the model's).")
    max_num_seqs: int = Field(16, ge=1, description="Largest batch of running requests.")
    max_num_batched_tokens: int | None = Field(
        None, description="Token budget of one step (None: vLLM's default)."
    )
    enable_prefix_caching: bool = Field(
        True, description="vLLM's own prefix caching (the `prefix` baseline); keep it on."
    )
    num_blocks: int | None = Field(
        None, ge=1, description="Override the KV block count (None: sized from kv_cache_gib)."
    )
    max_logprobs: int = Field(
        20, ge=-1, description="Most log-probs a request may ask for (-1: the whole vocabulary)."
    )
    log_stats: bool = Field(False, description="vLLM's Prometheus stats (preemptions, ...).")
    enforce_eager: bool = Field(True, description="No torch.compile (start-up in ~30-50 s).")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Fraction of GPU memory vLLM may use (GPU only)."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one model is split over.")
    seed: int = Field(0, description="Sampling seed.")
    allow_untested_vllm: bool = Field(
        False,
        description="Start even when the installed vLLM is outside the tested release range "
        "(`mpic.engine.vllm.version`; a loud warning instead of an error). The environment "
        "variable MPIC_ALLOW_UNTESTED_VLLM=1 does the same.",
    )

    @field_validator("block_size")
    @classmethod
    def _multiple_of_32(cls, value: int) -> int:
        if value <= 0 or value % 32:
            raise ValueError("block_size must be a positive multiple of 32 (vLLM CPU attention)")
        return value


class VllmEngineConfig(VllmOptions):
    """One vLLM engine for MPIC: the settings, the model and the store."""

    model: str = Field(description="HF model folder (config, weights, tokenizer, processor).")
    linking: bool = Field(True, description="Load the MPIC KV connector.")
    async_loads: bool | Literal["reads"] = Field(
        "reads",
        description="'reads' (default): read a linked request's entries in the background "
        "(vLLM's WAITING_FOR_REMOTE_KVS), link it inside a step; True: link it in the background "
        "too (the worker's linking thread, taking turns with vLLM's steps on the model; "
        "experimental, docs/vllm.md); false: both inside the step that schedules it.",
    )
    link_share: float = Field(
        1.0,
        gt=0,
        le=1,
        description="The background linking thread's share of the wall time while requests "
        "decode (1.0: full speed; lower protects their inter-token latency on a small host at "
        "the linked requests' time to first token).",
    )
    batch_links: bool = Field(
        True,
        description="Link the requests ready in one step in one selective pass (plain "
        "policies); false: one pass per request.",
    )
    link_prefix: bool = Field(
        True,
        description="Link the template/system prefix shared with the entries' canonical "
        "context exactly in the worker (mpic.linker.prefix: not recomputed, outside the budget; "
        "the reference runner's default too); false: recompute it.",
    )
    storage: StorageConfig = Field(
        default_factory=StorageConfig, description="Entry store the worker loads entries from."
    )
