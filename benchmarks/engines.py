"""Engines the offline benchmark can drive, by name (CLI process). `reference` is the HF
reference runner; other engines (e.g. `vllm`) register a factory with `register_engine`.

An engine caches images (entries in memory before timing starts), times one prompt's first
token under a policy, and decodes greedily.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from mpic.linker.prompt import PromptPart


@dataclass
class FirstToken:
    """One timed prefill."""

    ttft_s: float
    logits: torch.Tensor
    """float32 [vocab] first-token logits."""
    prompt_tokens: int
    recomputed_tokens: int
    cpu_s: float | None = None
    """Process CPU seconds of the prefill, where the engine can tell (busy shared hosts)."""


class BenchEngine(Protocol):
    """What `mpic bench offline` needs from an engine."""

    name: str

    def cache_image(self, media: bytes) -> str:
        """Compute the image's entry, keep it in memory, return its id."""
        ...

    def first_token(self, parts: Sequence[PromptPart], policy: str) -> FirstToken:
        """Prefill `parts` under `policy` and time the first token."""
        ...

    def greedy(self, parts: Sequence[PromptPart], policy: str, max_new_tokens: int) -> list[int]:
        """Exactly `max_new_tokens` greedy tokens (no early stop)."""
        ...


class ReferenceBenchEngine:
    """The HF reference runner (float32 on CPU unless a device is given)."""

    name = "reference"

    def __init__(self, model_dir: str, device: str = "cpu") -> None:
        from mpic.engine.hf.reference_runner import ReferenceRunner

        self.runner = ReferenceRunner(model_dir, device=device, dtype=torch.float32)

    def cache_image(self, media: bytes) -> str:
        """Entry id of the cached image."""
        return self.runner.cache_image(media).entry_id

    def first_token(self, parts: Sequence[PromptPart], policy: str) -> FirstToken:
        """Timed prefill (entries already in memory)."""
        out = self.runner.prefill(parts, policy)
        return FirstToken(
            out.ttft_s, out.logits, out.plan.num_tokens, out.recomputed_tokens, out.cpu_s
        )

    def greedy(self, parts: Sequence[PromptPart], policy: str, max_new_tokens: int) -> list[int]:
        """Greedy tokens after the policy's prefill."""
        gen = self.runner.generate(parts, policy, max_new_tokens, stop_at_eos=False)
        return gen.tokens


def _vllm_engine(model_dir: str) -> BenchEngine:
    """vLLM + the MPIC connector (imported only when asked for: vLLM starts processes)."""
    from mpic.benchmarks.vllm_engine import VllmBenchEngine

    return VllmBenchEngine(model_dir)


_ENGINES: dict[str, Callable[[str], BenchEngine]] = {
    "reference": ReferenceBenchEngine,
    "vllm": _vllm_engine,
}


def register_engine(name: str, factory: Callable[[str], BenchEngine]) -> None:
    """Make `--engine name` build `factory(model_dir)`."""
    _ENGINES[name] = factory


def get_engine(name: str, model_dir: str) -> BenchEngine:
    """The engine called `name` over `model_dir`; ValueError listing valid names otherwise."""
    if name not in _ENGINES:
        raise ValueError(f"unknown engine {name!r}; valid: {', '.join(sorted(_ENGINES))}")
    return _ENGINES[name](model_dir)
