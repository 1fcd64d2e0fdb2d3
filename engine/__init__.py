"""Engines that run models: `hf` (the reference runner on transformers' modules), `vllm` (vLLM
with the MPIC KV connector) and `tiny` (the random-weight model writer). Both backends implement
one protocol (`protocol`) and share what does not depend on the backend, in the modules directly
here: the request flow (`request_flow`), sampling (`sampling`), detokenizing (`detokenize`),
token bytes (`token_bytes`), image and document items (`items`), compressed item entries
(`item_press`) and the model folder (`model_dir`)."""
