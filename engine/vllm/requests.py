"""Requests for the vLLM engines (`VllmEngine`, `AsyncVllmEngine`): exact prompts and linked
(MPIC) prompts in the form vLLM's input processor expects (process that submits requests: CLI,
benchmark, Serve).

vLLM's processor expands every image placeholder into the image's T tokens, even a run that is
already expanded, so exact prompts and Qwen2-VL linked prompts carry ONE placeholder per image.
A LLaVA linked prompt is the plan's expanded token ids with no multimodal data (its 1-D
positions need none); a Qwen2-VL / Qwen2.5-VL one carries `image_grid_thw` per image and no
pixels, which lets vLLM expand the placeholders and give the last token its M-RoPE position
(docs/design.md "Platform notes"). Images differ in size, so each image's grid is its own: it is
read back from the plan's positions (an image linked at p spans rows p..p+gh-1 and columns
p..p+gw-1 of its merged grid), the same grid its entry was computed with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mpic.model_spec import ModelSpec
from mpic.types import MROPE_FAMILIES, LinkPlan


@dataclass
class EngineRequest:
    """One prompt for `VllmEngine.generate`: exact (plain vLLM) or linked (an MPIC plan)."""

    prompt_token_ids: list[int]
    multi_modal_data: dict[str, Any] | None = None
    """Images of an exact request, or the M-RoPE metadata of a linked Qwen2-VL one."""
    plan: LinkPlan | None = None
    """Linked requests: the plan with the policy's recompute depths (token ids = the prompt)."""
    policy: str = ""
    """Linked requests: the policy's canonical name (`VllmFrontEnd.policy_name`), what the
    request carries to vLLM's processes, where the connector parses it once."""
    fallback: EngineRequest | Callable[[], EngineRequest] | None = None
    """The exact request answering a linked one whose entries cannot be loaded, or a function
    building it (called only then: it may read the images' media from the store)."""
    cache_salt: str | None = None
    """Prefix-cache salt; None: none for exact requests, the plan's salt for linked ones."""


@dataclass
class EngineResult:
    """Greedy output of one request."""

    token_ids: list[int]
    num_cached_tokens: int = 0
    fell_back: bool = False
    """True when a linked request failed to link and was answered by its exact fallback."""
    logprobs: torch.Tensor | None = None
    """float32 [vocab] log-probabilities of the first generated token (when asked for)."""
    finish_reason: str | None = None
    """vLLM's: "stop" (an end id or stop token), "length" (`max_tokens`), None while decoding."""
    extra: dict[str, Any] = field(default_factory=dict)


def resolve_fallback(req: EngineRequest) -> EngineRequest:
    """The exact fallback of a linked request (built now if it was given as a function)."""
    assert req.fallback is not None
    return req.fallback() if callable(req.fallback) else req.fallback


def collapse_placeholders(token_ids: list[int], image_token_id: int) -> list[int]:
    """Each run of image tokens -> one placeholder."""
    return [
        t
        for i, t in enumerate(token_ids)
        if t != image_token_id or i == 0 or token_ids[i - 1] != image_token_id
    ]


def exact_request(plan: LinkPlan, image_token_id: int, images: list[Any]) -> EngineRequest:
    """The plain vLLM request for a plan's prompt: its images, placeholders collapsed."""
    ids = collapse_placeholders(plan.token_ids.tolist(), image_token_id)
    mm = {"image": images} if images else None
    return EngineRequest(prompt_token_ids=ids, multi_modal_data=mm)


def image_grids(plan: LinkPlan, image_token_id: int, merge: int) -> list[list[int]]:
    """[t, h, w] (before the merge) of each image occurrence of an M-RoPE plan, in prompt order,
    from the positions [3, N] of its tokens (an occurrence is a run of image tokens whose
    `source_offset` counts up from 0)."""
    image = (plan.token_ids == image_token_id).tolist()
    offset = plan.source_offset.tolist()
    grids, i, n = [], 0, plan.num_tokens
    while i < n:
        if not image[i]:
            i += 1
            continue
        j = i + 1
        while j < n and image[j] and offset[j] == offset[j - 1] + 1:
            j += 1
        pos = plan.positions[:, i:j]
        t, h, w = (int(row.max() - row.min()) + 1 for row in pos)
        grids.append([t, h * merge, w * merge])
        i = j
    return grids


def linked_request(
    plan: LinkPlan,
    policy: str,
    spec: ModelSpec,
    fallback: EngineRequest | Callable[[], EngineRequest] | None = None,
) -> EngineRequest:
    """An `EngineRequest` for a linked prompt (plan depths already set by the policy named
    `policy`, its canonical name)."""
    ids = plan.token_ids.tolist()
    mm = None
    if spec.family in MROPE_FAMILIES:
        ids = collapse_placeholders(ids, spec.image_token_id)
        grids = image_grids(plan, spec.image_token_id, spec.spatial_merge_size or 1)
        if grids:
            mm = {"image": {"image_grid_thw": torch.tensor(grids, dtype=torch.int64)}}
    return EngineRequest(
        prompt_token_ids=ids, multi_modal_data=mm, plan=plan, policy=policy, fallback=fallback
    )
