"""`scout-<b>`: query-aware selection under a budget of b (a fraction of the prompt's tokens) with
the APE-style correction of linked keys (linker; runs wherever a plan is built, its scout inside
`link_and_prefill`).

1. The plan recomputes the text (as MPIC does) and the last token; everything else is linked.
2. A scouting pass (`mpic.linker.scout`) runs the text over the linked item KV through the first
   layers and scores every item token by the attention the question and the last prompt row pay
   to it (ProphetKV's relevance to the user query, without a separate model).
3. `select`: the budget round(b * N) is filled with the text, each item occurrence's boundary
   tokens (its first `sinks` tokens, attention sinks as EPIC observes, and its last token), then
   the highest-scoring item tokens; those are recomputed at every layer in the one selective
   pass. The budget is a floor on nothing: when text and boundaries alone exceed it, they are
   still recomputed (the report says how many were).
4. `correction`: in every layer, each query's attention mass over the linked (not recomputed)
   item keys has its log-sum-exp multiplied by S (`mpic.kernels.correction`), in the prefill and
   while decoding on the reference engine. S comes from a per-budget table
   (`mpic.linker.scout_calibration`; `mpic model calibrate-scout` measures it per model) or from
   the name: `scout-0.2:s0.8` (`:s1` turns the correction off).

The name is canonical with S spelled out (`scout-0.2:s0.8`), so the vLLM worker, which rebuilds
the policy from its name, applies the same S as the front end that resolved it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mpic.linker.contracts import LayerAdapter
from mpic.linker.correction import LinkCorrection
from mpic.linker.linked_kv import LinkedKV
from mpic.linker.policies.base import Policy, text_depths
from mpic.linker.scout import ScoutReport, scout_scores
from mpic.types import CacheEntry, LinkPlan

SCOUT_LAYER_SPAN = (2 / 30, 8 / 30)
"""Scoring layers as fractions of depth: layers 2-8 of SmolLM2's 30 (2-16 scored the same on the
benchmark and cost twice the scout time; docs/fidelity.md)."""


def scout_layers(num_layers: int) -> list[int]:
    """The scoring layers for a model of `num_layers` (layers 2..8 on a 30-layer model)."""
    lo = max(1, round(num_layers * SCOUT_LAYER_SPAN[0]))
    hi = max(lo, min(num_layers - 1, round(num_layers * SCOUT_LAYER_SPAN[1])))
    return list(range(lo, hi + 1))


def boundary_mask(plan: LinkPlan, entries: Sequence[CacheEntry], sinks: int) -> torch.Tensor:
    """bool [N]: each item occurrence's first `sinks` tokens and its last token."""
    counts = torch.tensor([e.num_tokens for e in entries] + [0], dtype=torch.int64)
    size = counts[plan.source_entry]
    item = ~plan.is_text
    return item & ((plan.source_offset < sinks) | (plan.source_offset == size - 1))


class ScoutPolicy(Policy):
    """Query-aware selection at a budget fraction, with the linked-key correction."""

    def __init__(
        self,
        budget: float,
        scale: float | None = None,
        sinks: int = 1,
        question_weight: float = 0.5,
        layers: Sequence[int] | None = None,
        scout_correction: bool = False,
    ) -> None:
        if not 0.0 <= budget <= 1.0 or not math.isfinite(budget):
            raise ValueError(f"scout-b needs a budget fraction 0 <= b <= 1, got {budget}")
        if scale is None:
            from mpic.linker.scout_calibration import default_scale

            scale = default_scale(budget)
        if not 0.0 < scale <= 2.0:
            raise ValueError(f"scout's correction scale must be in (0, 2], got {scale}")
        self.budget = budget
        self.scale = float(scale)
        self.sinks = sinks
        self.question_weight = question_weight
        self.layers = list(layers) if layers is not None else None
        self.scout_correction = scout_correction
        self.name = f"scout-{budget:g}:s{self.scale:g}"

    @classmethod
    def from_arg(cls, arg: str, scales: Sequence[tuple[float, float]] | None = None) -> ScoutPolicy:
        """`0.2` or `0.2:s0.8` (the part after `scout-`); without `:s`, S comes from `scales`
        (a model's (budget, S) table) or the default table."""
        budget, _, rest = arg.partition(":")
        scale = None
        if rest:
            if not rest.startswith("s"):
                raise ValueError(f"expected ':s<S>' after the budget, got {rest!r}")
            scale = float(rest[1:])
        elif scales is not None:
            from mpic.linker.scout_calibration import interpolate

            scale = round(interpolate(scales, float(budget)), 3)
        return cls(float(budget), scale)

    @property
    def scouts(self) -> bool:
        """This policy decides its tokens after a scouting pass."""
        return True

    def scoring_layers(self, num_layers: int) -> list[int]:
        """The layers whose attention the scout scores."""
        return self.layers if self.layers is not None else scout_layers(num_layers)

    def scout(
        self,
        adapter: LayerAdapter,
        plan: LinkPlan,
        entries: Sequence[CacheEntry],
        linked_kv: LinkedKV,
    ) -> tuple[torch.Tensor, ScoutReport]:
        """Scores from `mpic.linker.scout` (optionally with the correction over every linked
        item token during the scout), then `select`."""
        num_layers = adapter.num_layers
        set_correction = getattr(linked_kv, "set_correction", None)
        if self.scout_correction and self.scale != 1.0 and set_correction is not None:
            set_correction(LinkCorrection(self.scale, ~plan.is_text, plan.recompute_depth))
        layers = self.scoring_layers(num_layers)
        scores, report = scout_scores(
            adapter, plan, entries, linked_kv, layers, self.question_weight
        )
        if set_correction is not None:
            set_correction(None)
        return self.select(plan, entries, scores, num_layers), report

    def depths(
        self, plan: LinkPlan, entries: Sequence[CacheEntry], num_layers: int
    ) -> torch.Tensor:
        """Before the scout: the text at every layer (the scout's tokens), items linked."""
        return text_depths(plan, num_layers)

    def budget_tokens(self, num_tokens: int) -> int:
        """round(b * N): tokens the selective pass may recompute."""
        return int(round(self.budget * num_tokens))

    def select(
        self,
        plan: LinkPlan,
        entries: Sequence[CacheEntry],
        scores: torch.Tensor,
        num_layers: int,
    ) -> torch.Tensor:
        """int64 [N] depths after the scout: text, boundaries, then the top-scored item tokens."""
        depth = plan.recompute_depth.clone()
        chosen = depth >= num_layers
        chosen |= boundary_mask(plan, entries, self.sinks)
        chosen[-1] = True
        room = self.budget_tokens(plan.num_tokens) - int(chosen.sum())
        if room > 0:
            free = (~plan.is_text) & ~chosen
            candidates = torch.nonzero(free).flatten()
            if candidates.numel():
                top = torch.topk(scores[candidates], min(room, candidates.numel())).indices
                chosen[candidates[top]] = True
        return torch.where(chosen, num_layers, 0).to(torch.int64)

    @property
    def corrects(self) -> bool:
        """True unless S == 1."""
        return self.scale != 1.0

    def correction(self, plan: LinkPlan, num_layers: int) -> LinkCorrection | None:
        """S over the plan's linked item tokens (None when S == 1)."""
        if self.scale == 1.0:
            return None
        return LinkCorrection(self.scale, ~plan.is_text, plan.recompute_depth.clone())
