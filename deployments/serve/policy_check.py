"""The served policy's check, where a chat is resolved (Resolver replica), and the one model fact
it needs, read when the application is built (CLI process or Serve controller).

A chat names its policy (`mpic.policy`, `mpic.recompute_budget` or the server's default,
`mpic.deployments.serve.resolver.budgeted_policy`); `check_policy` parses that name once into the
linker's `Policy` (the one the prompt carries to the worker, `LinkedPrompt.parsed_policy`) and
answers 400 (`mpic.policy`, the message listing the valid names) for an unknown or malformed
one, a number over `MAX_POLICY_NUMBER`, or more VLCache per-layer ratios (or a later scout
scoring layer, `scout-<b>:l<a>-<b>`) than the served model has layers. The layer count comes
from the model's own `config.json`, read by `model_layers` in the app builder and bound into the
Resolver, so validating a policy asks no other deployment: a chat is two Ray calls (Resolver,
then LLM worker). Where the builder cannot read it (the model
folder exists on the GPU nodes only, as in `k8s/rayservice.yaml`), the LLM worker checks the
layers of the parsed policy at `generate` from its own read (`check_layers`, no parse), still
within those two calls.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from mpic.deployments.config import EngineConfig
from mpic.errors import InvalidRequestError, MPICError
from mpic.linker.policies import Policy, check_depth, get_policy

logger = logging.getLogger(__name__)

MAX_POLICY_NUMBER = 1 << 20
"""Largest number a policy name may carry (`mpic-<k>`: k selected tokens per item): more than
any context, and far from integer overflow."""


def check_policy(name: str, num_layers: int | None) -> Policy:
    """The policy called `name`, validated for a model of `num_layers` layers (None: a model
    whose depth is unknown, such as the fake engine's; the layer check is skipped).

    InvalidRequestError (400, param `mpic.policy`) for a name `get_policy` refuses, a number
    over `MAX_POLICY_NUMBER` (its digits are counted before any int(): Python refuses to convert
    more than 4,300 digits, and a shorter huge number must not reach a policy constructor), or
    per-layer ratios the model cannot take."""
    width = len(str(MAX_POLICY_NUMBER))
    for digits in re.findall(r"\d+", name):
        if len(digits) > width or int(digits) > MAX_POLICY_NUMBER:
            shown = digits if len(digits) <= 24 else f"a {len(digits)}-digit number"
            raise InvalidRequestError(
                f"policy {name[:64]!r}: {shown} is out of range (at most {MAX_POLICY_NUMBER})",
                param="mpic.policy",
            )
    try:
        policy = get_policy(name)
    except (ValueError, OverflowError) as exc:
        raise InvalidRequestError(str(exc), param="mpic.policy") from None
    check_layers(policy, num_layers)
    return policy


def check_layers(policy: Policy, num_layers: int | None) -> None:
    """InvalidRequestError (400, param `mpic.policy`) when a parsed policy's per-layer ratios
    or scoring layers do not fit a model of `num_layers` layers (None: unknown, unchecked)."""
    if num_layers is None:
        return
    try:
        check_depth(policy, num_layers)  # more vlcache ratios, or a later scout layer, than it has
    except (ValueError, OverflowError) as exc:
        raise InvalidRequestError(str(exc), param="mpic.policy") from None


def model_layers(engine: EngineConfig) -> int | None:
    """The served model's layer count (the text model's `num_hidden_layers`, defaults filled in
    by transformers' `AutoConfig` as `mpic.model_spec.ModelSpec` reads it), from its
    `config.json` alone: a local folder, or the one object of an `s3://` prefix (no weights
    are read or copied). None for an engine without a model (`fake`, a custom class) or a
    config that cannot be read here (logged; `build_app` then has the LLM worker check the
    layers)."""
    if engine.kind not in ("reference", "vllm"):
        return None
    try:
        raw = _config_json(engine.model)
        from transformers import AutoConfig

        config = AutoConfig.for_model(**raw)  # model_type is one of the keys
        text = getattr(config, "text_config", None) or config
        return int(text.num_hidden_layers)
    except (OSError, ValueError, LookupError, AttributeError, TypeError, MPICError) as exc:
        logger.warning("model %s: layer count not read here (%s)", engine.model, exc)
        return None


def _config_json(model: str) -> dict:
    """The parsed `config.json` of a model folder or `s3://` prefix."""
    if not model.startswith("s3://"):
        return json.loads((Path(model).expanduser() / "config.json").read_text())
    from mpic.storage.factory import make_object_store

    store = make_object_store(model)
    try:
        return json.loads(store.get("config.json"))
    finally:
        store.close()
