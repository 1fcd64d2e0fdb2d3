"""vLLM's `vllm serve` flags on MPIC's config (CLI process): `mpic serve MODEL --max-model-len
4096 --api-key k ...` means what `vllm serve` means by them, applied over `--config` (or the
embedded default) by `apply_flags`, a pure function the command and the tests share.

A flag that has no meaning for the configured engine (a vLLM-only flag with `engine.kind:
reference`), a value vLLM would refuse (a context longer than the model's, an unknown dtype) or
a model folder MPIC cannot serve raises `FlagError`: the command prints it and exits with
status 2, as vLLM's argument parser does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from mpic.deployments.config import ServeAppConfig, VllmServeEngineConfig
from mpic.engine.vllm.config import DTYPES

VLLM_ONLY = (
    "gpu_memory_utilization",
    "tensor_parallel_size",
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_prefix_caching",
    "enforce_eager",
    "seed",
)
"""Flags that only the vLLM engine takes."""
API_KEY_USER = "default"
"""The user every `--api-key` key acts as (vLLM's keys are not per user; files are)."""


class FlagError(ValueError):
    """A flag MPIC cannot honour (exit status 2)."""


@dataclass
class ServeFlags:
    """The vLLM-named flags of `mpic serve` (None / empty: not given)."""

    model: str | None = None
    served_model_name: list[str] = field(default_factory=list)
    max_model_len: str | None = None
    gpu_memory_utilization: float | None = None
    tensor_parallel_size: int | None = None
    dtype: str | None = None
    api_key: list[str] = field(default_factory=list)
    chat_template: str | None = None
    block_size: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool | None = None
    enforce_eager: bool | None = None
    seed: int | None = None


def parse_length(text: str) -> int:
    """vLLM's `--max-model-len`: an integer, or with a k/m suffix (4k = 4000, 4K = 4096)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", text)
    if m is None:
        raise FlagError(f"--max-model-len {text!r}: an integer such as 4096 (or 4k, 4K)")
    number, unit = float(m[1]), m[2]
    scale = {"": 1, "k": 1000, "m": 10**6, "g": 10**9, "K": 1024, "M": 1 << 20, "G": 1 << 30}
    value = int(number * scale[unit])
    if value < 1:
        raise FlagError("--max-model-len must be at least 1")
    return value


def api_keys(values: list[str]) -> list[str]:
    """`--api-key` values, each possibly a comma-separated list (as vLLM takes them)."""
    keys = [k.strip() for v in values for k in v.split(",")]
    if any(not k for k in keys):
        raise FlagError("--api-key: empty key")
    return keys


def model_facts(model: str) -> tuple[str, int]:
    """(family, max_position_embeddings) read from the checkpoint's own config.json (a local
    folder, or an s3:// prefix copied locally first). FlagError when it cannot be served."""
    from mpic.engine.model_dir import resolve_model_dir
    from mpic.model_spec import ModelSpec

    try:
        spec = ModelSpec.from_pretrained(resolve_model_dir(model))
    except FileNotFoundError as exc:
        raise FlagError(f"model {model}: no config.json there ({exc})") from exc
    except (ValueError, OSError) as exc:
        raise FlagError(f"model {model}: {exc}") from exc
    return spec.family, spec.max_model_len


def apply_flags(cfg: ServeAppConfig, flags: ServeFlags, check_model: bool = True) -> ServeAppConfig:
    """`cfg` with the flags applied (they win over the config). `check_model`: read the model's
    config.json (family, context length) to refuse what vLLM would refuse at start."""
    engine: dict[str, Any] = cfg.engine.model_dump(exclude_unset=False)
    given = {k: v for k, v in vars(flags).items() if v not in (None, [])}
    if flags.model is not None:
        engine["model"] = flags.model
        if not flags.served_model_name:  # vLLM's default served name: the model argument
            engine["served_model_name"] = flags.model
    if flags.served_model_name:
        names = [n for v in flags.served_model_name for n in v.split(",") if n]
        engine["served_model_name"] = names[0] if len(names) == 1 else names
    if flags.chat_template is not None:
        from mpic.engine.hf.chat_template import read_template

        try:
            read_template(flags.chat_template)
        except (OSError, UnicodeDecodeError) as exc:
            raise FlagError(f"--chat-template: {exc}") from exc
        engine["chat_template"] = flags.chat_template
    if flags.dtype is not None:
        if flags.dtype not in DTYPES:
            raise FlagError(f"--dtype {flags.dtype!r}: choose from {', '.join(DTYPES)}")
        engine["dtype"] = DTYPES[flags.dtype]
    vllm_only = [k for k in VLLM_ONLY if k in given]
    if vllm_only and engine["kind"] != "vllm":
        names = ", ".join("--" + k.replace("_", "-") for k in vllm_only)
        raise FlagError(f"{names}: only the vllm engine takes them (engine.kind is "
                        f"{engine['kind']!r} in the config)")  # fmt: skip
    for key in VLLM_ONLY:
        if key in given:
            engine[key] = given[key]
    if flags.max_model_len is not None:
        if "max_model_len" not in type(cfg.engine).model_fields:
            raise FlagError(f"--max-model-len: the {engine['kind']} engine has no context limit")
        engine["max_model_len"] = parse_length(flags.max_model_len)
    if flags.model is not None and engine["kind"] in ("vllm", "reference") and check_model:
        family, positions = model_facts(flags.model)
        if family in VllmServeEngineConfig.model_fields["family"].annotation.__args__:
            engine["family"] = family
        limit = engine.get("max_model_len")
        if limit is not None and limit > positions:
            raise FlagError(
                f"--max-model-len {limit} is longer than the model's context "
                f"({positions} positions in its config.json)"
            )
    update: dict[str, Any] = {}
    if flags.api_key:
        update["auth"] = cfg.auth.model_copy(update={"mode": "production"})
    try:
        data = cfg.model_dump()
        data.update(engine=engine, **{k: v.model_dump() for k, v in update.items()})
        return ServeAppConfig.model_validate(data)
    except ValidationError as exc:
        raise FlagError(_first_error(exc)) from exc


def key_env(keys: list[str], current: str | None) -> str:
    """MPIC_API_KEYS (JSON key -> user) with `keys` added for `API_KEY_USER`."""
    mapping = json.loads(current) if current else {}
    mapping.update({k: API_KEY_USER for k in keys})
    return json.dumps(mapping)


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"] if p not in ("vllm", "reference", "fake"))
    return f"{where}: {err['msg']}"
