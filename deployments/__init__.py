"""Ray Serve deployments (ingress, encoder, retriever, linker, LLM worker) and the app builder."""
