"""The vLLM engine, in two rooms by process (the only package that imports `vllm`):

- here, the front end (the process that owns the engine: CLI, benchmark, Serve LLM-worker
  replica): `config` (how vLLM is started), `startup` (the CPU set-up, engine arguments with
  the MPIC connector), `frontend` (what both engines share: planning, request forms, uploads),
  `upload_prompt` (an item's canonical upload prompt as a vLLM request), `engine` (offline
  `LLM`), `async_engine` (`AsyncLLM`, streaming), `requests`, `sampling`, `version`; and what
  both rooms read: `params` (what a linked request carries in `kv_transfer_params`), `presses`
  (compressed item entries), `upload` (an item's entry computed by vLLM's own forward: its
  request params, and the KV capture the worker half runs), `plugin` (loaded by vLLM in every
  one of its processes);
- `connector/`, the MPIC KV connector inside vLLM's own processes: its scheduler half (engine
  core) and worker half (model runner), the link jobs between them, the batched selective pass,
  the paged KV ops per device, the layer adapter over vLLM's modules, the upload forward.
"""
