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

A dtype floor loads a second copy of the model; a backend floor shares the reference runner's
model and entries.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpic.engine.hf.reference_runner import ReferenceRunner
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
    """One floor: a runner that computes `full` differently, and the ids of the items it cached
    (the reference's entry id -> its own)."""

    name: str
    runner: ReferenceRunner
    ids: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The `policy` of its rows."""
        return floor_label(self.name)

    def cache_document(self, ref_id: str, text: str) -> None:
        """Cache the document the reference cached as `ref_id`."""
        self.ids[ref_id] = self.runner.cache_document(text).entry_id

    def cache_image(self, ref_id: str, media: bytes) -> None:
        """Cache the image the reference cached as `ref_id`."""
        self.ids[ref_id] = self.runner.cache_image(media).entry_id

    def parts(self, parts: Sequence[PromptPart]) -> list[PromptPart]:
        """The reference's prompt with this floor's entry ids (KeyError for an item not cached
        through `cache_document` / `cache_image`)."""
        from mpic.prompt_parts import DocumentRef, ImageRef

        out: list[PromptPart] = []
        for p in parts:
            if isinstance(p, DocumentRef):
                p = DocumentRef(self.ids[p.entry_id])
            elif isinstance(p, ImageRef):
                p = ImageRef(self.ids[p.entry_id])
            out.append(p)
        return out


def make_floor(runner: ReferenceRunner, model_dir: str, name: str) -> NoiseFloor:
    """The floor `name` (`NOISE_FLOORS`) of the reference `runner` loaded from `model_dir`.
    ValueError for an unknown name or one that is the reference's own computation (its dtype or
    its attention backend: bit-identical)."""
    import torch

    from mpic.kernels.attention import default_backend_name

    adapter = runner.adapter
    if name in DTYPE_FLOORS:
        dtype = getattr(torch, DTYPE_FLOORS[name])
        if adapter.dtype == dtype:
            raise ValueError(f"noise floor {name}: the reference already runs in {dtype}")
        from mpic.engine.hf.reference_runner import ReferenceRunner

        other = ReferenceRunner(
            model_dir,
            device=str(adapter.device),
            dtype=dtype,
            system_prompt=runner.system_prompt,
            attention_backend=runner.attention_backend,
            decode_correction=runner.decode_correction,
            link_prefix=False,  # `full` never links a prefix
        )
        return NoiseFloor(name, other)
    if name in BACKEND_FLOORS:
        own = runner.attention_backend
        if own is None:
            own = default_backend_name(adapter.device)
        if own == name:
            raise ValueError(
                f"noise floor {name}: the reference's own attention backend (bit-identical)"
            )
        other = copy.copy(runner)  # the same model, entries and settings
        other.attention_backend = name
        return NoiseFloor(name, other)
    raise ValueError(f"unknown noise floor {name!r}; valid: {', '.join(NOISE_FLOORS)}")


def kl_text(kl: float) -> str:
    """A KL for the table: 4 decimals, or 2 significant digits below 1e-4 (a noise floor)."""
    return f"{kl:.4f}" if kl >= 1e-4 or kl == 0 else f"{kl:.1e}"
