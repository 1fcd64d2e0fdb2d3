"""The Ray Serve application, in rooms by process and concern:

- `app.py` builds the deployment graph from ONE `ServeAppConfig` (`config.py`, with its sections
  `deployment_config.py`: resources and scaling per deployment, and `limits_config.py`: request
  limits); `local.py` starts it on a local Ray instance (`local_runs.py`: that instance's
  processes, recorded, ended, kept on the loopback); `messages.py` holds the torch-free messages
  every deployment exchanges, and `client_errors.py` how a client error (4xx) crosses a hop: as a
  value, not a replica failure.
- `http/`: the HTTP surface (Ingress replica).
- `serve/`: the deployments behind it (Resolver, Encoder, LLM worker, Retriever), the file catalog,
  admission and the cache-aware router.
- `monitoring/`: metrics and the live fidelity guarantee.
- `engines/`: the serve engines the Encoder and LLM-worker replicas drive (reference, vLLM, fake).
- `chat_request.py` and `file_schemas.py`: the HTTP API bodies the Resolver and the file
  deployments read too (the chat request; the file objects), below both `http/` and `serve/`
  (the bodies only the ingress answers with are in `http/`); the rooms import each other only
  downwards (`http/` -> `serve/` -> `monitoring/` -> `engines/`), checked by
  `scripts/import_graph.py`.
"""
