"""The application builder (CLI process / Serve controller): ONE `ServeAppConfig` -> the bound
deployment graph, Ray Serve LLM style (`serve.deployment(cls, **opts).bind(...)`).

`app_builder` is the `import_path` of `deployments/serve_config.yaml` and of the KubeRay
RayService's serveConfigV2: Serve validates the YAML `args` into `ServeAppConfig` and calls it.
"""

from __future__ import annotations

from ray import serve
from ray.serve import Application

from mpic.deployments.config import ServeAppConfig, deployment_options
from mpic.deployments.ingress import Ingress
from mpic.deployments.resolver import Resolver
from mpic.deployments.retriever import Retriever
from mpic.deployments.router import router_options
from mpic.deployments.workers import Encoder, LLMWorker


def build_app(config: ServeAppConfig) -> Application:
    """Bind Encoder, LLMWorker, Retriever, Resolver and the Ingress that routes to them."""
    encoder = serve.deployment(Encoder, **deployment_options("Encoder", config.encoder))
    worker = serve.deployment(
        LLMWorker,
        **deployment_options("LLMWorker", config.llm_worker),
        **router_options(config.llm_router),
    )
    retriever = serve.deployment(Retriever, **deployment_options("Retriever", config.retriever))
    resolver = serve.deployment(Resolver, **deployment_options("Resolver", config.resolver))
    ingress = serve.deployment(Ingress, **deployment_options("Ingress", config.ingress))
    enc, wrk = encoder.bind(config), worker.bind(config)
    ret = retriever.bind(config, wrk)
    return ingress.bind(config, enc, resolver.bind(config, enc, ret, wrk), wrk, ret)


def app_builder(args: ServeAppConfig) -> Application:
    """Entry point for `serve run` / serveConfigV2 (`import_path: ...app:app_builder`)."""
    return build_app(args)
