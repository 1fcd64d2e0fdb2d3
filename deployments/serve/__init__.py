"""The Serve deployments behind the ingress (Resolver, Encoder, LLM worker, Retriever replicas):
resolving a chat into a linked prompt, the model-holding workers, MRAG retrieval, the uploaded-file
catalog, admission and engine health, and the cache-aware router of worker requests."""
