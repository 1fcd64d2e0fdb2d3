"""Model-side code: tiny model writer, per-family layer adapters, the reference runner (HF
weights), and the vLLM engine wrapper, MPIC KV connector and plugin. `vllm` is imported only by
the `vllm_*` modules of this package."""
