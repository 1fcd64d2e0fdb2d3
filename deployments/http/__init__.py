"""The HTTP surface (Ingress Serve replica): the FastAPI routes of the OpenAI- and vLLM-compatible
API, their request and response bodies, typed errors -> OpenAI-style JSON, API keys, the request
guard and chat limits, TTFT-bounded shedding, readiness, and the client-side chat body."""
