"""The application builder (CLI process / Serve controller): ONE `ServeAppConfig` -> the bound
deployment graph, Ray Serve LLM style (`serve.deployment(cls, **opts).bind(...)`).

`app_builder` is the `import_path` of `deployments/serve_config.yaml` and of the KubeRay
RayService's serveConfigV2: Serve validates the YAML `args` into `ServeAppConfig` and calls it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray import serve
from ray.serve import Application

from mpic.deployments.client_errors import answering_client_errors
from mpic.deployments.config import DeploymentConfig, ServeAppConfig, deployment_options
from mpic.deployments.http.ingress import Ingress
from mpic.deployments.serve.policy_check import model_layers
from mpic.deployments.serve.resolver import Resolver
from mpic.deployments.serve.retriever import Retriever
from mpic.deployments.serve.router import router_options
from mpic.deployments.serve.workers import Encoder, LLMWorker


def build_app(
    config: ServeAppConfig, overrides: Mapping[str, Mapping[str, Any]] | None = None
) -> Application:
    """Bind Encoder, LLMWorker, Retriever, Resolver and the Ingress that routes to them. The
    model's layer count is read here (its config.json only) and bound into the Resolver, which
    checks a chat's policy against it without asking the worker; where the model folder is not
    readable here (it lives on the GPU nodes), the worker checks per-layer ratios itself.

    `overrides`: per-deployment options in the form of a Serve config's `deployments:` section
    (name -> `serve.deployment` options such as `num_replicas`, `autoscaling_config`,
    `ray_actor_options`, `max_ongoing_requests`); they win over the options derived from
    `config`, as Serve's own config file does (`mpic serve --config` applies them this way).

    The deployments behind the Ingress answer client errors (4xx) as values, not as exceptions
    Serve would log as replica failures (`mpic.deployments.client_errors`)."""

    def opts(name: str, dep: DeploymentConfig) -> dict[str, Any]:
        out = deployment_options(name, dep)
        out["logging_config"] = {"encoding": config.log_encoding}
        override = dict((overrides or {}).get(name, {}))
        override.pop("name", None)
        if "num_replicas" in override:
            out.pop("autoscaling_config", None)
        return {**out, **override}

    values = answering_client_errors
    encoder = serve.deployment(values(Encoder), **opts("Encoder", config.encoder))
    worker = serve.deployment(
        values(LLMWorker),
        **opts("LLMWorker", config.llm_worker),
        **router_options(config.llm_router),
    )
    retriever = serve.deployment(values(Retriever), **opts("Retriever", config.retriever))
    resolver = serve.deployment(values(Resolver), **opts("Resolver", config.resolver))
    ingress_cfg = config.ingress
    if config.limits.ttft_target_s:  # the app sheds (JSON 429), not Serve's proxy (plain 503)
        ongoing = max(ingress_cfg.max_ongoing_requests, config.limits.max_pending_requests)
        # and no bound on the proxy's queue for it: under CPU starvation Serve's router queues
        # requests while its replica probes are slow, and past max_queued_requests its proxy
        # answers a plain-text 503 (seen in a 300-request burst); the ingress sheds them instead
        ingress_cfg = ingress_cfg.model_copy(
            update={"max_ongoing_requests": ongoing, "max_queued_requests": -1}
        )
    ingress = serve.deployment(Ingress, **opts("Ingress", ingress_cfg))
    layers = model_layers(config.engine)  # None: no model, or its folder is not here
    enc, wrk = encoder.bind(config), worker.bind(config, check_policy_layers=layers is None)
    ret = retriever.bind(config, wrk)
    res = resolver.bind(config, ret, layers)  # checks policies itself, asking no worker
    return ingress.bind(config, enc, res, wrk, ret)


def app_builder(args: ServeAppConfig) -> Application:
    """Entry point for `serve run` / serveConfigV2 (`import_path: ...app:app_builder`)."""
    return build_app(args)
