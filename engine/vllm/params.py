"""What a linked request carries in vLLM's `kv_transfer_params` (front end -> vLLM worker).

Runs in the process that submits requests (engine wrapper, Serve worker) and in the vLLM worker
that decodes them. The link plan travels whole but small: every int64 field of `LinkPlan` is
run-length coded as arithmetic runs `[start, step, count]` (a prompt of 8 images x 576 tokens is
a few dozen runs), so it fits a JSON body of the OpenAI server as well as `SamplingParams`.

Prefix-cache hygiene (issue 5 item 4): vLLM hashes blocks by token ids, and a linked request's
image placeholders carry no pixels, so two prompts with different images would share hashes and
approximate KV could be served to an exact request. Every linked request gets a `cache_salt`
derived from its policy, its entries and its whole plan, so its blocks only ever match a request
that would write the very same KV.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from mpic.errors import InvalidRequestError
from mpic.types import LinkPlan

KEY = "mpic"
"""The key of `kv_transfer_params` that marks a request as linked by MPIC."""


def encode_runs(values: torch.Tensor) -> list[list[int]]:
    """int64 [N] -> [[start, step, count], ...] arithmetic runs (lossless)."""
    flat = values.tolist()
    runs: list[list[int]] = []
    i = 0
    while i < len(flat):
        step = flat[i + 1] - flat[i] if i + 1 < len(flat) else 0
        j = i + 1
        while j < len(flat) and flat[j] - flat[j - 1] == step:
            j += 1
        runs.append([flat[i], step, j - i])
        i = j
    return runs


def decode_runs(runs: list[list[int]]) -> torch.Tensor:
    """Inverse of `encode_runs`."""
    parts = [torch.arange(count, dtype=torch.int64) * step + start for start, step, count in runs]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def plan_to_params(plan: LinkPlan, policy: str) -> dict[str, Any]:
    """The `kv_transfer_params` of a linked request (JSON-serialisable)."""
    positions = plan.positions if plan.positions.dim() == 2 else plan.positions.unsqueeze(0)
    body = {
        "policy": policy,
        "entry_ids": list(plan.entry_ids),
        "num_tokens": plan.num_tokens,
        "positions": [encode_runs(row) for row in positions],
        "mrope": plan.positions.dim() == 2,
        "source_entry": encode_runs(plan.source_entry),
        "source_offset": encode_runs(plan.source_offset),
        "recompute_depth": encode_runs(plan.recompute_depth),
    }
    return {KEY: body}


def is_linked(params: dict[str, Any] | None) -> bool:
    """True when `kv_transfer_params` mark an MPIC linked request."""
    return bool(params) and KEY in params


def plan_from_params(params: dict[str, Any], token_ids: list[int]) -> tuple[LinkPlan, str]:
    """Rebuild (plan, policy) from `kv_transfer_params` and the request's prompt token ids."""
    try:
        body = params[KEY]
        positions = torch.stack([decode_runs(r) for r in body["positions"]])
        plan = LinkPlan(
            token_ids=torch.tensor(token_ids, dtype=torch.int64),
            positions=positions if body["mrope"] else positions[0],
            source_entry=decode_runs(body["source_entry"]),
            source_offset=decode_runs(body["source_offset"]),
            entry_ids=list(body["entry_ids"]),
            recompute_depth=decode_runs(body["recompute_depth"]),
        )
        policy = str(body["policy"])
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidRequestError(f"malformed MPIC kv_transfer_params: {exc}") from exc
    n = len(token_ids)
    if int(body["num_tokens"]) != n or any(
        t.shape[-1] != n for t in (plan.positions, plan.source_entry, plan.recompute_depth)
    ):
        raise InvalidRequestError("MPIC link plan does not match the prompt length")
    return plan, policy


def cache_salt(params: dict[str, Any]) -> str:
    """A prefix-cache salt unique to (policy, entries, plan): linked KV never meets exact KV."""
    digest = hashlib.sha256(json.dumps(params[KEY], sort_keys=True).encode()).hexdigest()
    return f"mpic-{params[KEY]['policy']}-{digest[:24]}"
