"""The application builder (CLI process / Serve controller): ONE `ServeAppConfig` -> the bound
deployment graph, Ray Serve LLM style (`serve.deployment(cls, **opts).bind(...)`).

`app_builder` is the `import_path` of `deployments/serve_config.yaml` and of the KubeRay
RayService's serveConfigV2: Serve validates the YAML `args` into `ServeAppConfig` and calls it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ray import serve
from ray.serve import Application

from mpic.deployments.client_errors import answering_client_errors
from mpic.deployments.config import ServeAppConfig
from mpic.deployments.deployment_config import DeploymentConfig, deployment_options
from mpic.deployments.http.ingress import Ingress
from mpic.deployments.serve.admission import WORKER_SIDE_CALLS, worker_capacity
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
    bounds = derived_bounds(config)
    worker_opts = with_env(opts("LLMWorker", bounds["llm_worker"]), cpu_worker_env(config))
    worker = serve.deployment(values(LLMWorker), **worker_opts, **router_options(config.llm_router))
    retriever = serve.deployment(values(Retriever), **opts("Retriever", bounds["retriever"]))
    resolver = serve.deployment(values(Resolver), **opts("Resolver", bounds["resolver"]))
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


CPU_WORKER_ENV = {"GOMP_SPINCOUNT": "30000"}
"""Environment of an LLM worker that runs vLLM on CPU (and of vLLM's processes it starts): its
OpenMP threads (torch's libgomp) spin 30,000 rounds after a parallel region, then sleep.

libgomp's default spins 300,000 rounds: between steps vLLM's worker process then held more
than one of 2 cores on average (105 %), and Serve's proxy, the ingress and the clients waited
for a core (at 64 clients a request took up to 20 s to reach the proxy; docs/serving.md
"Overload on the vLLM worker"). Not spinning at all (`OMP_WAIT_POLICY=PASSIVE`, the rule
before) freed the cores but woke the threads for every op: a linked prefill's many small ops
took 22-34 % longer alone (SmolLM2 with 4 documents on `AsyncVllmEngine`, median of 7:
mpic-32 337 vs 275 ms, `auto` 408 vs 305 ms). A short spin keeps the ops of one forward on
running threads and sleeps between steps: 288 / 329 ms alone, the worker idle at 0.6 % of a
core, the same behaviour at 64 clients (docs/serving.md)."""

OPENMP_KNOBS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
"""What an operator may set instead (either one wins: none of `CPU_WORKER_ENV` is added)."""


def cpu_worker_env(config: ServeAppConfig) -> dict[str, str]:
    """`CPU_WORKER_ENV` for a vLLM LLM worker without a GPU, unless this process's own
    environment sets an OpenMP wait knob (`OPENMP_KNOBS`: the operator's choice wins); empty
    otherwise."""
    if getattr(config.engine, "kind", None) != "vllm" or config.llm_worker.num_gpus:
        return {}
    if any(k in os.environ for k in OPENMP_KNOBS):
        return {}
    return dict(CPU_WORKER_ENV)


def with_env(options: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """`serve.deployment` options with `env` added to the replica's runtime_env `env_vars`
    (values already there win)."""
    if not env:
        return options
    actor = dict(options.get("ray_actor_options") or {})
    runtime_env = dict(actor.get("runtime_env") or {})
    runtime_env["env_vars"] = {**env, **(runtime_env.get("env_vars") or {})}
    actor["runtime_env"] = runtime_env
    return {**options, "ray_actor_options": actor}


def derived_bounds(config: ServeAppConfig) -> dict[str, DeploymentConfig]:
    """The Serve bounds of the deployments on the generation path, derived so that the LLM
    worker's engine budget (`worker_capacity`: 429 `engine_overloaded`) refuses before any
    Serve queue fills (whose back-pressure would otherwise be the answer):

    - `llm_worker.max_ongoing_requests`, unless set in the config: the budget's requests +
      `WORKER_SIDE_CALLS`, so every generation reaches the budget (Serve's default of 16 held
      the vLLM worker below its budget and queued the rest in Serve, where a burst overflowed
      the queue);
    - `max_queued_requests` of the resolver, retriever and LLM worker, unless set: -1 while the
      ingress's TTFT admission is on (it bounds what enters, as for the Ingress itself).

    Values set in the config (and the `deployments:` overrides of `build_app`) win."""
    requests, _ = worker_capacity(config)
    shedding = bool(config.limits.ttft_target_s)
    out: dict[str, DeploymentConfig] = {}
    for name in ("llm_worker", "retriever", "resolver"):
        dep: DeploymentConfig = getattr(config, name)
        update: dict[str, Any] = {}
        if name == "llm_worker" and "max_ongoing_requests" not in dep.model_fields_set:
            update["max_ongoing_requests"] = requests + WORKER_SIDE_CALLS
        if shedding and "max_queued_requests" not in dep.model_fields_set:
            update["max_queued_requests"] = -1
        out[name] = dep.model_copy(update=update) if update else dep
    return out


def app_builder(args: ServeAppConfig) -> Application:
    """Entry point for `serve run` / serveConfigV2 (`import_path: ...app:app_builder`)."""
    return build_app(args)
