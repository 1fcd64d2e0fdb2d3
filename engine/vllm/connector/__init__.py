"""The MPIC KV connector, inside vLLM's processes (`kv_connector_module_path` names
`kv_connector`):

- `kv_connector`: the thin `KVConnectorBase_V1` over the two halves;
- `scheduler`: the scheduler half (vLLM engine-core process): claims, link jobs, two-phase claims;
- `worker`: the worker half (vLLM worker process): entry reads, linking in or off the step;
- `link_job`: what the scheduler half ships to the worker half each step;
- `batched_link`: the linked requests of one step in one selective pass;
- `paged_kv` (`PagedLinkedKV`: a request's linked KV in vLLM's paged cache), with the cache
  layouts' ops per device in `paged_cpu` (vLLM's CPU backend) and `paged_cuda` (FlashAttention);
- `adapter` (the linker's `LayerAdapter` over vLLM's decoder modules), `model_lock` (one model
  user at a time: vLLM's step and the linking thread, and the linking thread's pacing).
"""
