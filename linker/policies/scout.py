"""`scout-<b>`: query-aware selection under a budget of b (a fraction of the prompt's tokens) with
the APE-style correction of linked keys (linker; runs wherever a plan is built, its scout inside
`link_and_prefill`).

1. The plan recomputes the text (as MPIC does) and the last token; everything else is linked.
2. A scouting pass (`mpic.linker.scout`) runs the text over the linked item KV through the first
   layers (2-5 of 30) and scores every item token by the attention the last prompt row (the one
   that produces the first output token; `question_weight` adds the question's rows) pays to it
   (ProphetKV's relevance to the user query, without a separate model).
3. `select`: the budget round(b * N) is filled with the text, each item occurrence's boundary
   tokens (its first `sinks` tokens, attention sinks as EPIC observes, and its last token), then
   the highest-scoring item tokens; those are recomputed at every layer in the one selective
   pass. The budget is a floor on nothing: when text and boundaries alone exceed it, they are
   still recomputed (the report says how many were).
4. `correction`: in every layer, each query's attention mass over the linked (not recomputed)
   item keys has its log-sum-exp multiplied by S (`mpic.kernels.correction`), in the prefill and
   while decoding on the reference engine; S may differ between the first and the second half
   of the layers. S comes from a per-budget table (`mpic.linker.scout_calibration`: 0.9 in the
   first half and 0.8 in the second at 20-30%; `mpic model calibrate-scout` measures one S per
   budget per model) or from the name: `scout-0.2:s0.8` (one S), `scout-0.2:s0.9/0.8` (first
   half / second half), `:s1` turns the correction off.

The name is canonical with S spelled out (`scout-0.2:s0.9/0.8`), so the vLLM worker, which
rebuilds the policy from its name, applies the same S as the front end that resolved it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mpic.linker.contracts import LayerAdapter
from mpic.linker.correction import LinkCorrection
from mpic.linker.link import LinkedItems, linked_items
from mpic.linker.linked_kv import LinkedKV
from mpic.linker.policies.base import Policy, text_depths
from mpic.linker.scout import ScoutReport, scout_scores
from mpic.types import CacheEntry, LinkPlan

SCOUT_LAYER_SPAN = (2 / 30, 5 / 30)
"""Scoring layers as fractions of depth: layers 2-5 of SmolLM2's 30 (2-8 and 2-16 scored within
a few percent of it on the benchmark and cost about 2x and 4x the scout time; docs/fidelity.md)."""


def scout_layers(num_layers: int) -> list[int]:
    """The scoring layers for a model of `num_layers` (layers 2..5 on a 30-layer model)."""
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
        question_weight: float = 0.0,
        layers: Sequence[int] | None = None,
        scout_correction: bool = False,
        late_scale: float | None = None,
    ) -> None:
        """scale: S (of the first half of the layers when `late_scale` is given); None: both
        halves from the default table. late_scale: S of the second half (None: `scale`)."""
        if not 0.0 <= budget <= 1.0 or not math.isfinite(budget):
            raise ValueError(f"scout-b needs a budget fraction 0 <= b <= 1, got {budget}")
        if scale is None:
            from mpic.linker.scout_calibration import default_scales

            scale, late = default_scales(budget)
            late_scale = late if late_scale is None else late_scale
        late_scale = scale if late_scale is None else late_scale
        for s in (scale, late_scale):
            if not 0.0 < s <= 2.0 or not math.isfinite(s):
                raise ValueError(f"scout's correction scale must be in (0, 2], got {s}")
        self.budget = budget
        self.scale = float(scale)
        """S of the first half of the layers."""
        self.late_scale = float(late_scale)
        """S of the second half of the layers (== `scale`: one S everywhere)."""
        self.sinks = sinks
        self.question_weight = question_weight
        self.layers = list(layers) if layers is not None else None
        self.scout_correction = scout_correction
        spelled = f"{self.scale:g}"
        if self.late_scale != self.scale:
            spelled += f"/{self.late_scale:g}"
        self.name = f"scout-{budget:g}:s{spelled}"

    @classmethod
    def from_arg(cls, arg: str, scales: Sequence[Sequence[float]] | None = None) -> ScoutPolicy:
        """`0.2`, `0.2:s0.8` or `0.2:s0.9/0.8` (the part after `scout-`: one S, or the first
        and the second half's); without `:s`, S comes from `scales` (a model's table: rows
        (budget, S) or (budget, S first half, S second half)) or the default tables."""
        budget, _, rest = arg.partition(":")
        scale = late = None
        if rest:
            if not rest.startswith("s"):
                raise ValueError(f"expected ':s<S>' or ':s<S>/<S>' after the budget, got {rest!r}")
            first, slash, second = rest[1:].partition("/")
            scale = float(first)
            late = float(second) if slash else None
        elif scales is not None:
            from mpic.linker.scout_calibration import table_scales

            scale, late = table_scales(scales, float(budget))
        return cls(float(budget), scale, late_scale=late)

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
        cached_prefix: int = 0,
        items: LinkedItems | None = None,
    ) -> tuple[torch.Tensor, ScoutReport]:
        """Scores from `mpic.linker.scout` (optionally with the correction over every linked
        item token during the scout), then `select` (the first `cached_prefix` tokens, linked
        exactly, are outside the budget; the scout still runs them, for exact scores). items:
        every item token's linked K/V (None: `linked_items` rotates them again)."""
        num_layers = adapter.num_layers
        set_correction = getattr(linked_kv, "set_correction", None)
        if self.scout_correction and self.corrects and set_correction is not None:
            set_correction(self._correction(plan, plan.recompute_depth, num_layers))
        layers = self.scoring_layers(num_layers)
        if items is None:
            items = linked_items(
                plan, entries, adapter.rope, num_layers, every_item=True, device=adapter.device
            )
        scores, report = scout_scores(
            adapter, plan, entries, linked_kv, layers, items, self.question_weight
        )
        if set_correction is not None:
            set_correction(None)
        return self.select(plan, entries, scores, num_layers, cached_prefix), report

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
        cached_prefix: int = 0,
    ) -> torch.Tensor:
        """int64 [N] depths after the scout: text, boundaries, then the top-scored item tokens
        (the first `cached_prefix` tokens get depth 0 and leave their share to items)."""
        depth = plan.recompute_depth.clone()
        chosen = depth >= num_layers
        chosen[:cached_prefix] = False
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
        """True unless S == 1 in both halves."""
        return self.scale != 1.0 or self.late_scale != 1.0

    def _correction(self, plan: LinkPlan, depth: torch.Tensor, num_layers: int) -> LinkCorrection:
        late = None if self.late_scale == self.scale else self.late_scale
        return LinkCorrection(
            self.scale, ~plan.is_text, depth, late_scale=late, split_layer=num_layers // 2
        )

    def correction(self, plan: LinkPlan, num_layers: int) -> LinkCorrection | None:
        """S over the plan's linked item tokens (None when S == 1 everywhere); layers
        >= num_layers // 2 get `late_scale`."""
        if not self.corrects:
            return None
        return self._correction(plan, plan.recompute_depth.clone(), num_layers)
