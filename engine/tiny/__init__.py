"""Random-weight model writer (CLI process): configs of each family at tiny/small sizes, an
offline-built tokenizer, and the HF folder writer that transformers and vLLM both load."""
