"""Engines that run models: `hf` (the reference runner on transformers' modules), `vllm` (vLLM
with the MPIC KV connector) and `tiny` (the random-weight model writer)."""
