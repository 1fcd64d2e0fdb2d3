"""The reference engine on Hugging Face weights: checkpoint loading, per-family layer adapters,
image encoding, cache-entry creation and the reference runner (any process that runs a model
with transformers' modules; CPU or CUDA)."""
