"""The MPIC KV connector for vLLM V1: a thin `KVConnectorBase_V1` over a scheduler half and a
worker half (each in its own module, as vLLM's own connectors are laid out).

Loaded by vLLM through `KVTransferConfig(kv_connector="MPICConnector",
kv_connector_module_path="mpic.engine.vllm.connector.kv_connector")` (see
`mpic.engine.vllm.startup.engine_kwargs`).
vLLM builds one instance per role, in different processes:

- SCHEDULER (engine core): `mpic.engine.vllm.connector.scheduler.MPICScheduler` claims a linked
  request's prompt tokens but the last, asynchronously where it can (vLLM's
  `WAITING_FOR_REMOTE_KVS`), and ships typed link jobs (`mpic.engine.vllm.connector.link_job`).
- WORKER: `mpic.engine.vllm.connector.worker.MPICWorker` reads the jobs' entries from the tiered
  store in the background, links the requests whose entries are in memory on its linking thread
  (one batched selective pass for plain policies) into their paged blocks with vLLM's own
  modules while vLLM's forwards go on, and reports them finished receiving; vLLM then
  computes the last prompt token over those blocks and decodes as usual (continuous
  batching). Uploads' KV is captured in the forward (`mpic.engine.vllm.upload`).

The two halves exchange only the per-step `MPICConnectorMetadata`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.forward_context import get_forward_context

from mpic.engine.vllm.connector.link_job import LinkJob, MPICConnectorMetadata
from mpic.engine.vllm.connector.scheduler import MPICScheduler
from mpic.engine.vllm.connector.worker import MPICWorker
from mpic.storage.config import StorageConfig

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["LinkJob", "MPICConnector", "MPICConnectorMetadata"]


class MPICConnector(KVConnectorBase_V1):
    """Delegates to `MPICScheduler` (scheduler role) or `MPICWorker` (worker role).

    `kv_connector_extra_config`: `storage` (the entry store, a `StorageConfig` dict),
    `async_loads` (the load mode, `link_job.load_mode`: "reads" (default) = entry reads off
    the step, linking in it; true = both off the step (experimental); false = in the step),
    `batch_links` (default true), `fetch_threads` (default 8), `link_share` (the linking
    thread's share of the wall time while requests decode, `LinkPacer` in
    `mpic.engine.vllm.connector.model_lock`; default 1.0), `link_prefix` (link the
    template/system prefix exactly, `mpic.linker.prefix`; default true)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        block_size = vllm_config.cache_config.block_size
        self.scheduler: MPICScheduler | None = None
        self.worker: MPICWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = MPICScheduler(block_size, extra.get("async_loads", "reads"))
        else:
            storage = StorageConfig.model_validate(extra.get("storage", {}))
            self.worker = MPICWorker(
                block_size,
                storage,
                int(extra.get("fetch_threads", 8)),
                bool(extra.get("batch_links", True)),
                extra.get("async_loads", "reads"),
                float(extra.get("link_share", 1.0)),
                bool(extra.get("link_prefix", True)),
            )

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        self.scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request)

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert self.worker is not None and isinstance(connector_metadata, MPICConnectorMetadata)
        self.worker.bind(connector_metadata, get_forward_context().attn_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, MPICConnectorMetadata)
        self.worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Links complete inside `start_load_kv`: nothing to wait for per layer."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing is read back from the paged cache (uploads capture K/V in the forward)."""

    def wait_for_save(self) -> None:
        assert self.worker is not None
        self.worker.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.worker is not None
        return self.worker.transfer_results()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        results = self.worker.transfer_results()
        return results.finished_sending, results.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
