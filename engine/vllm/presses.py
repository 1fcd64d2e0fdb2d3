"""KV presses on the vLLM path: compressed item entries (front end: the process that owns the
engine; worker side: `MPICConnector` in vLLM's worker).

vLLM keeps one block table and one sequence length per request for all layers, and has no
per-request eviction, so the presses' exact variants (per-layer budgets, per-head token sets,
merged entries) cannot live in its paged KV without patching vLLM. What fits is the
uniform-across-layers variant applied to cached items (`mpic.presses.entries`): a press chooses
C = max(1, round(b T)) of an item's T tokens from ALL layers' scores over the item's canonical
prefill, and the compressed entry (those tokens' K/V, positions, input embeddings) is stored
beside the full one under `press_entry_id(entry, press, budget)`. A prompt linking compressed
entries is shorter: the prompt vLLM schedules, the paged KV blocks it allocates and every decode
step shrink by (T - C) tokens per item.

How an entry is compressed (lazily, on first use of (entry, press, budget)): the front end sends
the item's canonical prompt as a linked request under policy `full` (`press_request`) whose
`kv_transfer_params` also carry `{"mpic_press": {"press", "budget"}}` and a unique cache salt
(vLLM's prefix cache must not skip the prefill). The connector's worker side then runs that
prefill with the presses' observer over vLLM's own modules and paged blocks
(`mpic.engine.item_press.press_item_entry`: the same code the reference runner uses, so both
engines choose from the same statistics) and writes the compressed entry to the entry store;
vLLM decodes one token and the request ends. The front end reads the entry back.

Families with M-RoPE (Qwen2-VL, Qwen2.5-VL) are refused: vLLM derives an image's token count and
positions from its grid (`image_grid_thw`), so an image with fewer tokens cannot be expressed.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from mpic.engine.item_press import canonical_planned
from mpic.engine.vllm.requests import linked_request
from mpic.errors import CorruptEntryError, InvalidRequestError
from mpic.model_spec import ModelSpec
from mpic.presses.entries import press_entry_id
from mpic.presses.registry import check_budget, get_press
from mpic.types import MROPE_FAMILIES, CacheEntry

KEY = "mpic_press"
"""The key of `kv_transfer_params` that marks a compression request."""


def check_press(spec: ModelSpec, press: str | None, budget: float | None) -> None:
    """InvalidRequestError (`mpic.press` / `mpic.budget`) for what the vLLM path cannot do: an
    unknown press, a budget outside (0, 1], a press on an M-RoPE family."""
    if press is None:
        return
    try:
        get_press(press)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="mpic.press") from None
    try:
        check_budget(1.0 if budget is None else budget)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="mpic.budget") from None
    if spec.family in MROPE_FAMILIES:
        raise InvalidRequestError(
            f"mpic.press: the vLLM engine compresses KV by storing images with fewer tokens, "
            f"which {spec.family} cannot express (vLLM derives an image's tokens from its "
            "M-RoPE grid); serve this model with the reference engine to use a press",
            param="mpic.press",
        )


def press_request(
    front_end: Any, entry: CacheEntry, press: str, budget: float
) -> tuple[dict[str, Any], Any]:
    """(prompt, SamplingParams) of the request that makes `entry`'s compressed entry in vLLM's
    worker (`front_end`: a `VllmFrontEnd`)."""
    plan = canonical_planned(front_end.spec, entry).plan
    req = linked_request(plan, "full", front_end.spec)
    prompt, sampling = front_end._submit_form(req, 1, False)
    params = sampling.extra_args["kv_transfer_params"]
    params[KEY] = {"press": press, "budget": float(budget)}
    prompt["cache_salt"] = f"mpic-press-{uuid.uuid4().hex}"  # never a prefix-cache hit
    return prompt, sampling


def press_entry(
    front_end: Any,
    entry: CacheEntry,
    press: str,
    budget: float,
    run: Callable[[dict[str, Any], Any], Any],
) -> CacheEntry:
    """`entry` compressed by `press` at `budget` (the uniform variant): read from the store when
    it exists, else made by vLLM's worker through `run(prompt, sampling)` (the engine's way of
    running one request to its end) and read back. Budget 1.0 returns `entry` itself (nothing
    to compress: the same prompt and tokens as no press)."""
    check_press(front_end.spec, press, budget)
    if check_budget(budget) >= 1.0:
        return entry
    key = press_entry_id(entry.entry_id, press, budget)
    if front_end.store.locate(key) is None:
        run(*press_request(front_end, entry, press, budget))
        if front_end.store.locate(key) is None:
            raise CorruptEntryError(
                f"vLLM's worker did not store the {press} entry of {entry.entry_id!r} "
                "(its entry could not be loaded)"
            )
    return front_end.store.get(key)
