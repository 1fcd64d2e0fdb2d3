"""The noise floor of `mpic bench fidelity`'s metrics (CLI process): how far exact recomputation
itself drifts under a change that should not matter.

A policy's first-token KL, greedy agreement@32, ROUGE-L and task accuracy are measured against
`full` (every token recomputed) on the same prompt. Those figures only mean something next to the
drift of `full` itself under a numerically different but equivalent computation: a floor is the
same prompts under full prefill with one such change, compared with the reference's `full` the
same way a policy is (`mpic.benchmarks.fidelity.bench.run_fidelity` and
`mpic.benchmarks.fidelity.task.run_task` add one row per floor, named `floor_label(name)`).

Variants (`NOISE_FLOORS`):
- `bf16`, `fp16`: the model loaded and run in bfloat16 / float16 (weights, activations, KV; the
  reference runs in float32): the rounding a serving engine in half precision adds;
- `flex`, `sdpa_runs`: the reference's dtype with the other attention backend of
  `mpic.kernels.attention` (FlexAttention vs one SDPA call per run of queries): float32
  reassociation only. The reference's own backend is refused (bit-identical: a floor of exactly 0
  means nothing).

Each floor is an `Engine` of its own, the reference engine's `variant` (an optional `Engine`
member): a dtype floor loads a second copy of the model; a backend floor shares the reference
engine's model and entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mpic.benchmarks.fidelity.answers import Answer, Answers, engine_of

if TYPE_CHECKING:
    from mpic.prompt_parts import PromptPart

DTYPE_FLOORS = {"bf16": "bfloat16", "fp16": "float16"}
"""Floors that run the model in another dtype (name -> torch dtype name)."""

BACKEND_FLOORS = ("flex", "sdpa_runs")
"""Floors that run the reference's dtype with another attention backend."""

NOISE_FLOORS: tuple[str, ...] = (*DTYPE_FLOORS, *BACKEND_FLOORS)
"""Every floor name `parse_floors` accepts."""


def floor_label(name: str) -> str:
    """The `policy` of a floor's result rows, e.g. `noise-floor (bf16 full)`."""
    return f"noise-floor ({name} full)"


def parse_floors(text: str) -> list[str]:
    """Comma-separated floor names in order, repeats dropped; "none" or "" gives []. ValueError
    for an unknown name."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if names == ["none"]:
        return []
    bad = [x for x in names if x not in NOISE_FLOORS]
    if bad:
        raise ValueError(
            f"unknown noise floor {bad[0]!r}; valid: {', '.join(NOISE_FLOORS)} or none"
        )
    return list(dict.fromkeys(names))


@dataclass
class NoiseFloor:
    """One floor: an engine that computes `full` differently (its `answers`), and the ids of the
    items it cached (the reference's entry id -> its own)."""

    name: str
    answers: Answers
    ids: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The `policy` of its rows."""
        return floor_label(self.name)

    def add_document(self, ref_id: str, text: str) -> None:
        """Cache the document the reference cached as `ref_id`."""
        self.ids[ref_id] = self.answers.add_document(text)

    def add_image(self, ref_id: str, media: bytes) -> None:
        """Cache the image the reference cached as `ref_id`."""
        self.ids[ref_id] = self.answers.add_image(media)

    def parts(self, parts: Sequence[PromptPart]) -> list[PromptPart]:
        """The reference's prompt with this floor's entry ids (KeyError for an item not cached
        through `add_document` / `add_image`)."""
        from mpic.prompt_parts import DocumentRef, ImageRef

        out: list[PromptPart] = []
        for p in parts:
            if isinstance(p, DocumentRef):
                p = DocumentRef(self.ids[p.entry_id])
            elif isinstance(p, ImageRef):
                p = ImageRef(self.ids[p.entry_id])
            out.append(p)
        return out

    def answer(self, parts: Sequence[PromptPart], max_tokens: int) -> Answer:
        """The greedy answer of the reference's prompt `parts` under full prefill computed this
        floor's way."""
        return self.answers.answer(self.parts(parts), "full", max_tokens)

    def close(self) -> None:
        """Close its requests' event loop (the engine stays up)."""
        self.answers.close()


def make_floor(engine: Any, model_dir: str, name: str) -> NoiseFloor:
    """The floor `name` (`NOISE_FLOORS`) of the reference `engine` (an `Engine` with the optional
    member `variant`, the reference engine; a bare reference runner is wrapped) loaded from
    `model_dir`. ValueError for an unknown name, an engine without `variant`, or a floor that is
    the reference's own computation (its dtype or its attention backend: bit-identical)."""
    if name in DTYPE_FLOORS:
        how = {"dtype": DTYPE_FLOORS[name]}
    elif name in BACKEND_FLOORS:
        how = {"attention": name}
    else:
        raise ValueError(f"unknown noise floor {name!r}; valid: {', '.join(NOISE_FLOORS)}")
    variant = getattr(engine_of(engine), "variant", None)
    if variant is None:
        raise ValueError(f"noise floor {name}: the engine computes no variant of itself")
    try:
        other = variant(model_dir, **how)
    except ValueError as exc:
        raise ValueError(f"noise floor {name}: {exc}") from exc
    return NoiseFloor(name, Answers(other))


def kl_text(kl: float) -> str:
    """A KL for the table: 4 decimals, or 2 significant digits below 1e-4 (a noise floor)."""
    return f"{kl:.4f}" if kl >= 1e-4 or kl == 0 else f"{kl:.1e}"
