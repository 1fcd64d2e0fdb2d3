"""`scout-<b>`: query-aware selection under a budget of b (a fraction of the prompt's tokens) with
the APE-style correction of linked keys (linker; runs wherever a plan is built, its scout in the
scout stage of the link pass, `mpic.linker.pipeline.link_pass`, batched with the other scouting
requests of the pass).

1. The plan recomputes the text (as MPIC does) and the last token; everything else is linked.
2. A scouting pass (`mpic.linker.scout`) runs the text over the linked item KV through the first
   layers (2-5 of 30) and scores every item token by the attention the last prompt row (the one
   that produces the first output token; `question_weight` adds the question's rows) pays to it
   (ProphetKV's relevance to the user query, without a separate model).
3. `select`: the budget round(b * N) is filled with the text, each item occurrence's boundary
   tokens (its first `sinks` tokens, attention sinks as EPIC observes, and its last token), then
   the item tokens of the highest score x offset prior; those are recomputed at every layer in
   the one selective pass. The offset prior (1 + o / tau) ** -0.5 of a token at offset o in its
   item (`offset_prior`, tau = `OFFSET_TAU` = 8) follows how far a linked token's KV is from
   the exact one, on average, by its place in the item: on SmolLM2 with 8 documents the
   values' relative deviation is 0.6 at offset 0, 0.42 at 8, 0.34 at 16 and 0.16 at 120-160
   (docs/fidelity.md, "Why the default lost the needle"). Attention alone ranks what the last
   row reads; a linked token whose KV is nearly exact gains little from being recomputed. The
   budget is a floor on nothing: when text and boundaries alone exceed it, they are still
   recomputed (the report says how many were).
4. `correction`: in every layer, each query's attention mass over the linked (not recomputed) item
   keys has its log-sum-exp multiplied by S (`mpic.kernels.correction`), in the prefill (decoding is
   plain attention unless `ReferenceRunner(decode_correction=True)`); S may differ between the first
   and the second half of the layers. S comes from a per-budget table
   (`mpic.linker.policies.scout_scales`: 0.975 in the first half and 0.85 in the second at 15-20%
   since the canonical context's lead-in; `mpic model calibrate-scout` measures one S per budget per
   model) or from the name: `scout-0.2:s0.8` (one S), `scout-0.2:s0.9/0.8` (first half / second
   half), `:s1` turns the correction off. These are the documents' S: a prompt whose item tokens are
   mostly image tokens takes `image_scale` (`:i<S>`, default `IMAGE_SCALE` = 1, no correction) in
   every layer.

More name fields, after S: `:i<S>` (the images' S, above), `:k<K>` recomputes the first K tokens of
every item occurrence (default 1; `:k8` is what the needle task needs at 8 documents, at a cost in
first-token KL: docs/fidelity.md), `:d<tau>` sets the offset prior's tau (`:d0`: no prior, attention
alone, the selection before 2026-11-27). The name is canonical with S spelled out and K / tau
spelled when not the default (`scout-0.2:s0.9/0.8`, `scout-0.2:s0.9/0.8:k8:d0`), so the vLLM
connector, which parses the name it receives once per request, selects with the same fields as the
front end that resolved it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mpic.linker.contracts import LayerAdapter
from mpic.linker.correction import LinkCorrection
from mpic.linker.kv.linked import LinkedKV
from mpic.linker.link import LinkedItems, linked_items
from mpic.linker.policies.base import Policy, text_depths
from mpic.linker.scout import ScoutTask
from mpic.types import CacheEntry, LinkPlan

SCOUT_LAYER_SPAN = (2 / 30, 5 / 30)
"""Scoring layers as fractions of depth: layers 2-5 of SmolLM2's 30 (2-8 and 2-16 scored within
a few percent of it on the benchmark and cost about 2x and 4x the scout time; docs/fidelity.md)."""


def scout_layers(num_layers: int, span: tuple[float, float] = SCOUT_LAYER_SPAN) -> list[int]:
    """The scoring layers for a model of `num_layers` (layers 2..5 on a 30-layer model): `span`
    (fractions of depth) at that depth, from layer 1 at the least to the last layer at most."""
    lo = max(1, round(num_layers * span[0]))
    hi = max(lo, min(num_layers - 1, round(num_layers * span[1])))
    return list(range(lo, hi + 1))


MAX_LAYER = 1023
"""The largest layer number a name may spell (a model's own depth is checked at planning)."""


def parse_layers(text: str) -> list[int]:
    """A name's `:l` field -> layer numbers: `2-12` (2..12), `3` (3 alone), runs joined by `_`
    (`2-5_9-9`); ValueError for anything else."""
    layers: list[int] = []
    for run in text.split("_"):
        first, dash, last = run.partition("-")
        a, b = int(first), int(last) if dash else int(first)
        if a < 0 or b < a or b > MAX_LAYER:
            raise ValueError(
                f"scoring layers {run!r}: expected <a>-<b> with 0 <= a <= b <= {MAX_LAYER}"
            )
        layers += range(a, b + 1)
    return layers


def spell_layers(layers: Sequence[int]) -> str:
    """Sorted layer numbers as `parse_layers` reads them: runs `a-b` joined by `_`."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return "_".join(f"{a}-{b}" for a, b in runs)


IMAGE_SCALE = 1.0
"""S of the default for prompts whose linked items are mostly images: none (1). With the
canonical context's lead-in (`mpic.linker.prompt.CONTEXT_LEAD_IN`) the images' linked KV needs
no correction, and any S < 1 costs (LLaVA with the trained SmolLM2, 4 pictures, 18%: S 1 0.038,
0.95 0.143, the documents' 0.89 / 0.81 0.305; docs/fidelity.md)."""

OFFSET_TAU = 8.0
"""tau of the default offset prior (1 + o / tau) ** -0.5 (`offset_prior`): fitted to the linked
values' deviation from the exact prefill's by offset in a document (SmolLM2, 8 documents)."""


def offset_prior(plan: LinkPlan, tau: float) -> torch.Tensor:
    """float32 [N]: (1 + o / tau) ** -0.5 for an item token at offset o in its item (1 for text
    and for every token when tau is 0: no prior)."""
    if tau <= 0:
        return torch.ones(plan.num_tokens, dtype=torch.float32)
    offset = plan.source_offset.clamp_min(0).to(torch.float32)
    return (1.0 + offset / tau) ** -0.5


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
        question_weight: float | None = None,
        layers: Sequence[int] | None = None,
        scout_correction: bool = False,
        late_scale: float | None = None,
        offset_tau: float = OFFSET_TAU,
        image_scale: float = IMAGE_SCALE,
    ) -> None:
        """scale: S (of the first half of the layers when `late_scale` is given); None: both
        halves from the default table. late_scale: S of the second half (None: `scale`).
        sinks: leading tokens of every item occurrence always recomputed (with its last token).
        offset_tau: tau of the offset prior that weighs the scout's scores (0: none).
        image_scale: S in every layer for a prompt whose linked item tokens are mostly image
        tokens (`IMAGE_SCALE`, 1: no correction). layers: the scoring layers (None: the depth's
        default span, `scout_layers`); question_weight: w_q of the scout's equation (None: 0).
        Layers or a weight left None take a model's own table's (`with_scales`)."""
        if not 0.0 <= budget <= 1.0 or not math.isfinite(budget):
            raise ValueError(f"scout-b needs a budget fraction 0 <= b <= 1, got {budget}")
        if sinks < 0 or sinks != int(sinks):
            raise ValueError(
                f"scout's boundary tokens per item must be an integer >= 0, got {sinks}"
            )
        if not 0.0 <= offset_tau <= 1e6:
            raise ValueError(f"scout's offset prior tau must be in [0, 1e6], got {offset_tau}")
        self.tabled = scale is None
        """S came from the default tables (no S given): a model's own table replaces it
        (`with_scales`)."""
        if scale is None:
            from mpic.linker.policies.scout_scales import default_scales

            scale, late = default_scales(budget)
            late_scale = late if late_scale is None else late_scale
        late_scale = scale if late_scale is None else late_scale
        for s in (scale, late_scale, image_scale):
            if not 0.0 < s <= 2.0 or not math.isfinite(s):
                raise ValueError(f"scout's correction scale must be in (0, 2], got {s}")
        self.budget = budget
        self.scale = float(scale)
        """S of the first half of the layers."""
        self.late_scale = float(late_scale)
        """S of the second half of the layers (== `scale`: one S everywhere)."""
        self.sinks = int(sinks)
        self.offset_tau = float(offset_tau)
        """tau of the offset prior (0: attention scores alone)."""
        self.image_scale = float(image_scale)
        """S in every layer when most linked item tokens are image tokens (`correction`)."""
        if question_weight is not None and not 0.0 <= question_weight <= 100.0:
            raise ValueError(f"scout's question weight must be in [0, 100], got {question_weight}")
        if layers is not None and (not layers or min(int(x) for x in layers) < 0):
            raise ValueError(f"scout's scoring layers must be layer numbers >= 0, got {layers}")
        self.weight_given = question_weight is not None
        """w_q was given (a name's `:w`): a model's table does not replace it."""
        self.question_weight = float(question_weight or 0.0)
        self.layers = sorted({int(x) for x in layers}) if layers is not None else None
        self.scout_correction = scout_correction
        spelled = f"{self.scale:g}"
        if self.late_scale != self.scale:
            spelled += f"/{self.late_scale:g}"
        if self.image_scale != IMAGE_SCALE:
            spelled += f":i{self.image_scale:g}"
        if self.sinks != 1:
            spelled += f":k{self.sinks}"
        if self.offset_tau != OFFSET_TAU:
            spelled += f":d{self.offset_tau:g}"
        if self.layers is not None:
            spelled += f":l{spell_layers(self.layers)}"
        if self.weight_given:  # spelled whenever given (`:w0` too): a table does not replace it
            spelled += f":w{self.question_weight:g}"
        self.name = f"scout-{budget:g}:s{spelled}"

    @classmethod
    def from_arg(cls, arg: str, scales: Sequence[Sequence[float]] | None = None) -> ScoutPolicy:
        """`0.2`, `0.2:s0.8` or `0.2:s0.9/0.8` (the part after `scout-`: one S, or the first
        and the second half's), then optionally `:i<S>` (the S of mostly-image prompts),
        `:k<K>` (boundary tokens per item), `:d<tau>` (the offset prior's tau), `:l<a>-<b>`
        (the scoring layers a..b; runs joined by `_`: `:l2-5_9-9`) and `:w<w>` (the question
        weight), in that order; without `:s`, S comes from `scales` (a model's table, rows
        (budget, S) or (budget, S first half, S second half), `scout_scales.ScoutTable`) or
        the default tables, and without `:l` / `:w` the layers and weight from the table's
        scout fields, if it has them, or the defaults."""
        budget, *fields = arg.split(":")
        scale = late = None
        options: dict[str, float] = {}
        layers: list[int] | None = None
        order = "ikdlw"
        for i, field in enumerate(fields):
            key, value = field[:1], field[1:]
            seen = [*options, *("l" if layers is not None else "")]
            if key == "s" and i == 0:
                first, slash, second = value.partition("/")
                scale = float(first)
                late = float(second) if slash else None
            elif key and key in order and all(order.index(k) < order.index(key) for k in seen):
                if key == "l":
                    layers = parse_layers(value)
                else:
                    options[key] = float(value)
            else:
                raise ValueError(
                    f"expected ':s<S>[/<S>]', ':i<S>', ':k<K>', ':d<tau>', ':l<a>-<b>', ':w<w>' "
                    f"(in that order), got {field!r}"
                )
        if scale is None and scales is not None:
            from mpic.linker.policies.scout_scales import table_scales

            scale, late = table_scales(scales, float(budget))
        sinks = options.get("k", 1.0)
        if sinks != int(sinks):
            raise ValueError(f"scout's boundary tokens per item must be an integer, got {sinks:g}")
        tau = options.get("d", OFFSET_TAU)
        image = options.get("i", IMAGE_SCALE)
        return cls(
            float(budget),
            scale,
            sinks=int(sinks),
            late_scale=late,
            offset_tau=tau,
            image_scale=image,
            layers=layers if layers is not None else getattr(scales, "layers", None),
            question_weight=options.get("w", getattr(scales, "question_weight", None)),
        )

    def with_scales(self, scales: Sequence[Sequence[float]] | None) -> ScoutPolicy:
        """With S from a model's table (rows (budget, S) or (budget, S first half, S second
        half)) when S came from the default tables; the same fields otherwise (as
        `get_policy(name, scales=scales)` for the name this policy was parsed from)."""
        if scales is None:
            return self
        layers = self.layers if self.layers is not None else getattr(scales, "layers", None)
        weight = (
            self.question_weight if self.weight_given else getattr(scales, "question_weight", None)
        )
        if not self.tabled and layers == self.layers and weight in (None, self.question_weight):
            return self
        from mpic.linker.policies.scout_scales import table_scales

        early, late = (
            table_scales(scales, self.budget) if self.tabled else (self.scale, self.late_scale)
        )
        return ScoutPolicy(
            self.budget,
            early,
            sinks=self.sinks,
            question_weight=weight,
            layers=layers,
            scout_correction=self.scout_correction,
            late_scale=late,
            offset_tau=self.offset_tau,
            image_scale=self.image_scale,
        )

    @property
    def scouts(self) -> bool:
        """This policy decides its tokens after a scouting pass."""
        return True

    def scoring_layers(self, num_layers: int) -> list[int]:
        """The layers whose attention the scout scores; ValueError when a layer given (`:l`, a
        model's table) is not one of the model's `num_layers`."""
        if self.layers is None:
            return scout_layers(num_layers)
        if self.layers[-1] >= num_layers:
            raise ValueError(
                f"{self.name}: scoring layer {self.layers[-1]} is past the model's {num_layers} "
                f"layers (0-{num_layers - 1})"
            )
        return self.layers

    def scout_task(
        self,
        adapter: LayerAdapter,
        plan: LinkPlan,
        entries: Sequence[CacheEntry],
        linked_kv: LinkedKV,
        items: LinkedItems | None = None,
        offset: int = 0,
    ) -> ScoutTask:
        """This request's share of the scouting pass (`mpic.linker.scout.scout_pass`, which
        scores; `select` then chooses): its scoring layers and question weight, and, with
        `scout_correction`, the correction over every linked item token set on `linked_kv` for
        the scout (the link pass clears it after). items: every item token's linked K/V (None:
        `linked_items` rotates them again); offset: the request's first index in the linked KV
        the pass runs over."""
        num_layers = adapter.num_layers
        set_correction = getattr(linked_kv, "set_correction", None)
        if self.scout_correction and set_correction is not None:
            correction = self._correction(plan, entries, plan.recompute_depth, num_layers)
            if correction is not None:
                set_correction(correction)
        layers = self.scoring_layers(num_layers)
        if items is None:
            items = linked_items(
                plan, entries, adapter.rope, num_layers, every_item=True, device=adapter.device
            )
        return ScoutTask(plan, entries, items, layers, self.question_weight, offset)

    def depths(
        self, plan: LinkPlan, entries: Sequence[CacheEntry], num_layers: int
    ) -> torch.Tensor:
        """Before the scout: the text at every layer (the scout's tokens), items linked
        (ValueError, at planning time, for scoring layers the model does not have)."""
        self.scoring_layers(num_layers)
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
        """int64 [N] depths after the scout: text, boundaries, then the item tokens of the
        highest score x offset prior (the first `cached_prefix` tokens get depth 0 and leave
        their share to items)."""
        chosen = plan.recompute_depth >= num_layers
        if cached_prefix:
            chosen[:cached_prefix] = False
        chosen |= boundary_mask(plan, entries, self.sinks)
        chosen[-1] = True
        room = self.budget_tokens(plan.num_tokens) - int(chosen.sum())
        if room > 0:
            free = (~plan.is_text) & ~chosen
            candidates = torch.nonzero(free).flatten()
            if candidates.numel():
                weighted = scores.float() * offset_prior(plan, self.offset_tau)
                top = torch.topk(weighted[candidates], min(room, candidates.numel())).indices
                chosen[candidates[top]] = True
        return torch.where(chosen, num_layers, 0)  # int64

    @property
    def corrects(self) -> bool:
        """True unless S == 1 in both halves."""
        return self.scale != 1.0 or self.late_scale != 1.0

    def _correction(
        self,
        plan: LinkPlan,
        entries: Sequence[CacheEntry],
        depth: torch.Tensor,
        num_layers: int,
    ) -> LinkCorrection | None:
        """The correction over `depth`: the documents' S (`scale`, `late_scale` from
        num_layers // 2 on), or `image_scale` in every layer when most of the plan's item tokens
        come from image entries (`mostly_images`); None when that S is 1 everywhere."""
        early, late = self.scale, self.late_scale
        if mostly_images(plan, entries):
            early = late = self.image_scale
        if early == 1.0 and late == 1.0:
            return None
        return LinkCorrection(
            early,
            ~plan.is_text,
            depth,
            late_scale=None if late == early else late,
            split_layer=num_layers // 2,
        )

    def correction(
        self, plan: LinkPlan, num_layers: int, entries: Sequence[CacheEntry] = ()
    ) -> LinkCorrection | None:
        """S over the plan's linked item tokens (None when S == 1 everywhere); layers
        >= num_layers // 2 get `late_scale`. When most of the plan's item tokens come from
        image entries (`entries`, aligned with the plan's), `image_scale` in every layer
        instead: with the canonical context's lead-in, linked image tokens need a gentler S than
        documents (docs/fidelity.md, "The canonical context's lead-in")."""
        return self._correction(plan, entries, plan.recompute_depth.clone(), num_layers)


def mostly_images(plan: LinkPlan, entries: Sequence[CacheEntry]) -> bool:
    """True when more than half of the plan's item tokens come from image entries (False
    without `entries`)."""
    if not entries:
        return False
    is_image = torch.tensor([e.media_type == "image" for e in entries] + [False])
    images = int(is_image[plan.source_entry].sum())
    return images * 2 > int((~plan.is_text).sum())
