"""Resources and scaling of each Serve deployment (CLI process and Serve controller): the
`DeploymentConfig` the application config holds per deployment (`ingress`, `encoder`, `retriever`,
`resolver`, `llm_worker`), its autoscaling range, and `deployment_options(...)`, which turns one
into the keyword arguments of `serve.deployment(...)` (Ray Serve LLM style).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from mpic.errors import InvalidRequestError

DEPLOYMENT_NAMES = ("Ingress", "Encoder", "Retriever", "Resolver", "LLMWorker")
"""The Serve deployment names; the k8s test checks serveConfigV2 against this tuple."""


class AutoscalingOptions(BaseModel):
    """Ray Serve in-tree autoscaling of one deployment (`autoscaling_config`)."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0, description="Fewest replicas kept running.")
    max_replicas: int = Field(1, ge=1, description="Most replicas Serve may start.")
    target_ongoing_requests: float = Field(
        2.0, gt=0, description="Ongoing requests per replica Serve aims for (Ray >= 2.60 name)."
    )
    upscale_delay_s: float = Field(3.0, ge=0, description="How long load must stay high.")
    downscale_delay_s: float = Field(60.0, ge=0, description="How long load must stay low.")
    metrics_interval_s: float = Field(1.0, gt=0, description="How often replicas report load.")
    look_back_period_s: float = Field(5.0, gt=0, description="Window the load is averaged over.")


class DeploymentConfig(BaseModel):
    """Resources and scaling of one deployment."""

    model_config = ConfigDict(extra="forbid")

    num_cpus: float = Field(0.1, ge=0, description="CPUs reserved per replica (fractions ok).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (LLM worker on GPU nodes).")
    max_ongoing_requests: int = Field(
        16,
        ge=1,
        description="Concurrent requests per replica. Unset on the LLM worker: its engine "
        "budget (limits.max_requests_in_flight, vLLM's max_num_seqs + engine_queue_seqs) + 8, so "
        "the budget, not Serve's queue, refuses first (deployments/app.py).",
    )
    max_queued_requests: int = Field(
        64,
        ge=-1,
        description="Requests a caller may queue for this deployment beyond max_ongoing_requests "
        "(Serve's bound; past it HTTP 429 engine_overloaded with Retry-After); -1: unbounded. "
        "Unset, the deployments on the generation path get -1 while the ingress's TTFT "
        "admission is on (it bounds what enters; deployments/app.py).",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources per replica (pins replicas to nodes that offer them).",
    )
    autoscaling: AutoscalingOptions = Field(
        default_factory=AutoscalingOptions, description="Replica range and scaling target."
    )
    health_check_period_s: float = Field(
        2.0,
        gt=0,
        description="Serve calls each replica's `check_health` this often; 3 failures in a row "
        "replace the replica (an LLM worker whose engine died is replaced ~3 periods after; "
        "Serve's own default is 10 s).",
    )
    health_check_timeout_s: float = Field(
        10.0, gt=0, description="A health check slower than this counts as failed (Serve: 30 s)."
    )


def deployment_options(name: str, cfg: DeploymentConfig) -> dict[str, Any]:
    """Keyword arguments of `serve.deployment(cls, **opts)` for one deployment."""
    a = cfg.autoscaling
    if a.min_replicas > a.max_replicas:
        raise InvalidRequestError(f"{name}: min_replicas {a.min_replicas} > max {a.max_replicas}")
    actor: dict[str, Any] = {"num_cpus": cfg.num_cpus}
    if cfg.num_gpus:
        actor["num_gpus"] = cfg.num_gpus
    if cfg.resources:
        actor["resources"] = dict(cfg.resources)
    return {
        "name": name,
        "ray_actor_options": actor,
        "max_ongoing_requests": cfg.max_ongoing_requests,
        "max_queued_requests": cfg.max_queued_requests,
        "autoscaling_config": {**a.model_dump(), "initial_replicas": max(a.min_replicas, 1)},
        "health_check_period_s": cfg.health_check_period_s,
        "health_check_timeout_s": cfg.health_check_timeout_s,
    }
