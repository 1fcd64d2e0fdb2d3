"""The rows of the `mpic bench compress` table (CLI process): per (press, budget) means over the
prompts, and the uncompressed `none` row. Shared by the reference run (`bench`) and the vLLM run
(`vllm_bench`); the columns are defined in `mpic.benchmarks.compress.bench`'s docstring."""

from __future__ import annotations

import statistics
from typing import Any


def baseline_row(refs: list[dict[str, Any]]) -> dict[str, Any]:
    """The `none` row (budget 1.0) from the uncompressed runs (`kv_bytes`, `ms_per_token`,
    `prompt_tokens` each)."""
    full_bytes = statistics.mean(r["kv_bytes"] for r in refs)
    return press_row(
        "none",
        1.0,
        [full_bytes],
        full_bytes,
        [r["ms_per_token"] for r in refs],
        [0.0],
        [1.0],
        [1.0],
        statistics.mean(r["prompt_tokens"] for r in refs),
    )


def press_row(
    press: str,
    budget: float,
    kv_bytes: list[float],
    full_bytes: float,
    ms: list[float],
    kl: list[float],
    top1: list[float],
    agree: list[float],
    prompt_tokens: float,
) -> dict[str, Any]:
    """One table row from per-prompt figures (means over the prompts)."""
    held = statistics.mean(kv_bytes)
    return {
        "press": press,
        "budget": budget,
        "kv_bytes": held,
        "kv_bytes_full": full_bytes,
        "kv_reduction": 1.0 - held / full_bytes,
        "decode_ms_per_token": statistics.mean(ms),
        "kl_mean": statistics.mean(kl),
        "top1_match": statistics.mean(top1),
        "token_agreement": statistics.mean(agree),
        "prompt_tokens": prompt_tokens,
    }
