"""The serve engines the Encoder and LLM-worker Serve replicas drive: the small `ServeEngine`
interface and its thin adapters over the engine protocol (reference, vLLM) plus the model-free fake;
chat turns -> prompt parts, and vLLM's tokenize/detokenize on the served tokenizer."""
