"""One timed prefill as a benchmark engine reports it (CLI process): the record every bench
engine returns from `first_token` (`mpic.benchmarks.offline.engines.BenchEngine`; not the serving
side's first-token distribution, `mpic.engine.first_token.FirstToken`). Its own module so that
engines in other modules (`vllm_engine`) import it without importing the registry."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TimedPrefill:
    """One timed prefill."""

    ttft_s: float
    logits: torch.Tensor
    """float32 [vocab] first-token logits."""
    prompt_tokens: int
    recomputed_tokens: int
    cpu_s: float | None = None
    """Process CPU seconds of the prefill, where the engine can tell (busy shared hosts)."""
