"""The vLLM engine. Front-end side (the process that owns the engine: `engine`, `async_engine`,
`frontend`, `requests`, `params`) and worker side (vLLM's scheduler and worker processes:
`connector`, `plugin`, `adapter`, `paged_kv`, `upload`). The only package that imports `vllm`."""
