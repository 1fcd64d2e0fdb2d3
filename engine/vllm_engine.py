"""vLLM V1 engine wrapper with the MPIC connector (offline scripts, benchmarks, Serve LLM worker).

Runs in the process that owns the engine (a CLI/benchmark process or a Ray Serve replica); vLLM
starts its engine core and worker in child processes, which load `mpic.engine.vllm_connector`
and the `mpic` general plugin (`mpic.engine.vllm_plugin`) themselves.

Every CPU set-up step of ENVIRONMENT.md lives in `prepare_environment` (the ONE place):
- `VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache) from `VllmEngineConfig.kv_cache_gib`;
- `VLLM_WORKER_MULTIPROC_METHOD=spawn`: vLLM's children are spawned, never forked from a process
  that already runs torch threads (callers' scripts need `if __name__ == "__main__":`);
- float32 on CPU (bf16 is ~5x slower on these AVX2 cores) and `block_size` a multiple of 32
  (the CPU attention kernel's requirement), both enforced by the config;
- the torchvision shim for CPU torch is NOT here: it must run at interpreter start-up, so
  scripts/setup.sh installs it as a `.pth` (scripts/torchvision_cpu_shim.py documents it).
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from mpic.engine import vllm_params, vllm_upload
from mpic.engine.entries import canonical_context_key
from mpic.engine.model_spec import ModelSpec
from mpic.engine.vision import fit_image, load_image
from mpic.engine.vllm_requests import EngineRequest, EngineResult
from mpic.errors import CorruptEntryError
from mpic.linker.prompt import canonical_context_ids
from mpic.storage.config import StorageConfig
from mpic.storage.entry_codec import entry_key
from mpic.storage.entry_store import EntryStore
from mpic.types import CacheEntry

logger = logging.getLogger(__name__)

CONNECTOR = "MPICConnector"
CONNECTOR_MODULE = "mpic.engine.vllm_connector"


class VllmEngineConfig(BaseModel):
    """How to start vLLM for MPIC."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="HF model folder (config, weights, tokenizer, processor).")
    dtype: str = Field("float32", description="Model dtype; float32 on CPU (bf16 ~5x slower).")
    block_size: int = Field(32, description="KV block size; a multiple of 32 on CPU.")
    kv_cache_gib: int = Field(1, ge=1, description="CPU KV cache size (VLLM_CPU_KVCACHE_SPACE).")
    max_model_len: int | None = Field(None, description="Context limit (None: the model's).")
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
    seed: int = Field(0, description="Sampling seed.")
    linking: bool = Field(True, description="Load the MPIC KV connector.")
    storage: StorageConfig = Field(
        default_factory=StorageConfig, description="Entry store the worker loads entries from."
    )

    @field_validator("block_size")
    @classmethod
    def _multiple_of_32(cls, value: int) -> int:
        if value <= 0 or value % 32:
            raise ValueError("block_size must be a positive multiple of 32 (vLLM CPU attention)")
        return value


def prepare_environment(cfg: VllmEngineConfig) -> None:
    """Set the process environment vLLM reads at start-up (see the module docstring)."""
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gib)
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


class VllmEngine:
    """A vLLM `LLM` with the MPIC connector; greedy generation of exact and linked requests."""

    def __init__(self, cfg: VllmEngineConfig) -> None:
        prepare_environment(cfg)
        from vllm import LLM
        from vllm.config import KVTransferConfig

        self.cfg = cfg
        self.spec = ModelSpec.from_pretrained(cfg.model)
        self._processor: Any = None
        self.store = EntryStore.from_config(cfg.storage)
        """The entry store (the worker opens the same durable store from `cfg.storage`)."""
        self.fallbacks = 0
        """Linked requests answered by exact recomputation because an entry could not load."""
        kv_transfer = None
        if cfg.linking:
            kv_transfer = KVTransferConfig(
                kv_connector=CONNECTOR,
                kv_connector_module_path=CONNECTOR_MODULE,
                kv_role="kv_both",
                kv_load_failure_policy="fail",
                kv_connector_extra_config={"storage": cfg.storage.model_dump(mode="json")},
            )
        optional = {"num_gpu_blocks_override": cfg.num_blocks,
                    "max_num_batched_tokens": cfg.max_num_batched_tokens}
        self.llm = LLM(
            model=cfg.model, dtype=cfg.dtype, block_size=cfg.block_size,
            max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
            enable_prefix_caching=cfg.enable_prefix_caching, enforce_eager=cfg.enforce_eager,
            seed=cfg.seed, kv_transfer_config=kv_transfer, limit_mm_per_prompt={"image": 16},
            disable_log_stats=not cfg.log_stats, max_logprobs=cfg.max_logprobs,
            **{k: v for k, v in optional.items() if v is not None},
        )

    def _submit_form(
        self, req: EngineRequest, max_tokens: int, logprobs: bool
    ) -> tuple[dict, Any]:
        from vllm import SamplingParams

        prompt: dict[str, Any] = {"prompt_token_ids": list(req.prompt_token_ids)}
        if req.multi_modal_data:
            prompt["multi_modal_data"] = req.multi_modal_data
        extra = None
        if req.plan is not None:
            params = vllm_params.plan_to_params(req.plan, req.policy)
            prompt["cache_salt"] = vllm_params.cache_salt(params)
            extra = {"kv_transfer_params": params}
        if req.cache_salt is not None:
            prompt["cache_salt"] = req.cache_salt
        sampling = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra,
            logprobs=-1 if logprobs else None,
        )
        return prompt, sampling

    def generate(
        self, requests: list[EngineRequest], max_tokens: int = 8, logprobs: bool = False
    ) -> list[EngineResult]:
        """Greedy-decode `requests` together (continuous batching); linked requests whose entries
        fail to load are answered by their `fallback` (logged, counted in `self.fallbacks`).
        With `logprobs`, each result carries the first token's log-probs over the vocabulary
        (needs `max_logprobs=-1`)."""
        forms = [self._submit_form(r, max_tokens, logprobs) for r in requests]
        outputs = self.llm.generate([f[0] for f in forms], [f[1] for f in forms], use_tqdm=False)
        results = []
        retry: list[int] = []
        for i, out in enumerate(outputs):
            completion = out.outputs[0]
            if requests[i].plan is not None and completion.finish_reason not in ("length", "stop"):
                retry.append(i)
            results.append(
                EngineResult(
                    token_ids=list(completion.token_ids),
                    num_cached_tokens=int(out.num_cached_tokens or 0),
                    logprobs=self._first_logprobs(completion.logprobs) if logprobs else None,
                )
            )
        if retry:
            self._recompute(requests, results, retry, max_tokens, logprobs)
        return results

    def _first_logprobs(self, steps: Any) -> torch.Tensor | None:
        if not steps:
            return None
        out = torch.full((self.spec.vocab_size,), float("-inf"))
        for token_id, entry in steps[0].items():
            out[token_id] = entry.logprob
        return out

    def _recompute(
        self, requests: list[EngineRequest], results: list[EngineResult], retry: list[int],
        max_tokens: int, logprobs: bool,
    ) -> None:
        missing = [i for i in retry if requests[i].fallback is None]
        if missing:
            raise CorruptEntryError(f"linked requests {missing} could not load their entries "
                                    "and carry no exact fallback")
        self.fallbacks += len(retry)
        logger.warning("MPIC: %d linked request(s) could not link; recomputing exactly", len(retry))
        again = self.generate([requests[i].fallback for i in retry], max_tokens, logprobs)
        for i, res in zip(retry, again, strict=True):
            res.fell_back = True
            results[i] = res

    @property
    def processor(self) -> Any:
        """The model's HF processor (chat template, tokenizer), loaded once."""
        if self._processor is None:
            from transformers import AutoProcessor

            self._processor = AutoProcessor.from_pretrained(self.cfg.model)
        return self._processor

    def cache_image(self, media: bytes, system_prompt: str | None = None) -> CacheEntry:
        """Upload path: the cache entry of an image computed by vLLM and written to the store.

        Same canonical context, fitted image size and content address as the reference runner
        (`mpic.engine.entries.cache_image`), so both engines name an image's entry alike.
        """
        image = fit_image(load_image(media), self.spec.image_size)
        context = canonical_context_ids(self.processor, system_prompt, self.spec.image_token_id)
        entry_id = entry_key(self.spec.fingerprint, canonical_context_key(context), media)
        ids = context + [self.spec.image_token_id]
        if self.spec.vision_end_id is not None:
            ids.append(self.spec.vision_end_id)
        extra: dict[str, Any] = {"context_token_ids": list(context)}
        if self.spec.image_grid_thw is not None:
            extra["image_grid_thw"] = list(self.spec.image_grid_thw)
        span = (len(context), len(context) + self.spec.tokens_per_image)
        return self.compute_entry(ids, {"image": image}, span, entry_id, extra)

    def compute_entry(
        self, prompt_token_ids: list[int], multi_modal_data: dict[str, Any], span: tuple[int, int],
        entry_id: str, extra: dict[str, Any] | None = None,
    ) -> CacheEntry:
        """Run a prompt (one placeholder per image) with its images through vLLM and store the
        KV of the expanded prompt's tokens [span) as `entry_id` (`mpic.engine.vllm_upload`)."""
        from vllm import SamplingParams

        fingerprint = self.spec.fingerprint
        params = vllm_upload.upload_params(entry_id, fingerprint, *span, extra=extra)
        prompt = {
            "prompt_token_ids": list(prompt_token_ids),
            "multi_modal_data": multi_modal_data,
            "cache_salt": f"mpic-upload-{entry_id}-{uuid.uuid4().hex}",
        }
        sampling = SamplingParams(
            temperature=0.0, max_tokens=1, extra_args={"kv_transfer_params": params}
        )
        self.llm.generate([prompt], [sampling], use_tqdm=False)
        return self.store.get(entry_id)

    def metric(self, name: str) -> float:
        """A vLLM counter/gauge summed over labels, e.g. "vllm:num_preemptions" (needs
        `log_stats`)."""
        return float(sum(getattr(m, "value", 0) for m in self.llm.get_metrics() if m.name == name))

    def worker_cpu_s(self) -> float:
        """CPU seconds used so far by vLLM's worker process(es), where the model runs (a busy
        shared host makes wall-clock time noisy; CPU time still measures the work)."""
        import psutil

        total = 0.0
        for child in psutil.Process().children(recursive=True):
            try:
                if child.name().startswith("VLLM::Worker"):
                    times = child.cpu_times()
                    total += times.user + times.system
            except psutil.NoSuchProcess:
                continue
        return total

    def close(self) -> None:
        """Stop vLLM's engine-core and worker processes."""
        self.llm.llm_engine.engine_core.shutdown()
