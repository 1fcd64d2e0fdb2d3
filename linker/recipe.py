"""The one recipe from a request to a finished link plan (linker; every engine and benchmark).

render (chat template) -> resolve (entry ids -> entries) -> build_plan (positions, sources) ->
policy (recompute depths, `Policy.apply`). For most policies these depths are final:
`link_and_prefill` and the vLLM worker take them as they come (the worker rebuilds the plan from
the request's `kv_transfer_params`, depths included). Scouting policies (`scout-*`, and `auto` /
`auto-<b>`, which resolve to one; `auto` is the serving default) get only the scout's tokens
here (text and the last token at every layer, items linked): `link_and_prefill` applies the
policy again to the plan it is given (a plan carrying an earlier run's final depths scouts from
scratch), runs the scout and replaces the depths with the scout's selection.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mpic.linker.plan import build_plan, resolve_entries, unique_entries
from mpic.linker.policies import Policy, get_policy
from mpic.linker.prefix import CachedPrefix
from mpic.linker.prompt import ChatTokenizer, image_refs, render_prompt_ids
from mpic.model_spec import ModelSpec
from mpic.prompt_parts import PromptPart
from mpic.types import CacheEntry, LinkPlan


@dataclass(frozen=True)
class PlannedPrompt:
    """A link plan with its policy's recompute depths, ready to link and prefill."""

    plan: LinkPlan
    """Depths set by `policy` (N = plan.num_tokens)."""
    entries: list[CacheEntry]
    """Aligned with `plan.entry_ids` (each entry once)."""
    policy: Policy
    """Two-step policies and in-pass hooks (CacheBlend) still act during the prefill."""
    refs: list[str]
    """The entry ids the prompt references, in prompt order with repeats (exact fallbacks)."""
    prefix: CachedPrefix | None = None
    """The template/system prefix linked exactly (`mpic.linker.prefix`; reference runner with
    `link_prefix`), None: every text token is recomputed."""


def with_policy(
    plan: LinkPlan,
    entries: Sequence[CacheEntry],
    policy: str | Policy,
    num_layers: int,
    refs: Sequence[str] = (),
) -> PlannedPrompt:
    """Apply `policy` (a name is parsed here: tests, benchmarks) to a fresh plan from
    `build_plan` (final depths, except for scouting policies: `link_and_prefill` re-applies
    them and lets the scout set the final depths)."""
    rule = get_policy(policy) if isinstance(policy, str) else policy
    return PlannedPrompt(rule.apply(plan, entries, num_layers), list(entries), rule, list(refs))


def plan_prompt(
    spec: ModelSpec,
    tokenizer: ChatTokenizer,
    parts: Sequence[PromptPart],
    entries: Mapping[str, CacheEntry],
    policy: Policy,
    system_prompt: str | None,
    max_new_tokens: int = 0,
) -> PlannedPrompt:
    """The finished plan of `parts` under `policy` (parsed by the caller, once per request);
    raises `InvalidRequestError` (bad parts, too long) or `NotFoundError` (an entry id not in
    `entries`)."""
    token_ids = render_prompt_ids(tokenizer, parts, system_prompt)
    refs = image_refs(parts)
    items = resolve_entries(refs, entries)
    plan = build_plan(spec, token_ids, items, max_new_tokens)
    return with_policy(plan, unique_entries(plan, items), policy, spec.num_layers, refs)
