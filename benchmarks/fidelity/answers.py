"""A policy's greedy answer as the fidelity benchmarks score it (`bench`, `task`): the reference
runner's one pass, or with exact decoding the engines' own two-pass flow
(`mpic.engine.request_flow.decode_steps` over `mpic.engine.hf.engine.ReferenceEngine`: the
policy's first token, then decoding over the prompt's exact KV)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpic.engine.hf.engine import ReferenceEngine
    from mpic.engine.hf.reference_runner import Generation, ReferenceRunner
    from mpic.prompt_parts import PromptPart


@functools.cache
def _engine(runner: ReferenceRunner) -> ReferenceEngine:
    """The protocol backend over `runner`, made once."""
    from mpic.engine.hf.engine import ReferenceEngine

    return ReferenceEngine(runner)


def greedy_answer(
    runner: ReferenceRunner,
    parts: Sequence[PromptPart],
    policy: str,
    max_tokens: int,
    exact_decode: bool = False,
) -> Generation:
    """The greedy answer of `parts` under `policy` (at most `max_tokens` tokens, an end id
    included) with the prefill its first token came from; `exact_decode`: the tokens after the
    first are decoded over the exact KV (`GenerateRequest.exact_decode`), the prefill is the
    policy's own (its logits, plan and recomputed share score KL)."""
    from mpic.engine.hf.reference_runner import Generation
    from mpic.engine.protocol import GenerateRequest
    from mpic.engine.request_flow import decoded_ids, exact_policy

    if not exact_decode or exact_policy(policy):
        return runner.generate(parts, policy, max_tokens)
    request = GenerateRequest(
        parts, dict(runner.entries), policy, max_tokens=max_tokens, exact_decode=True
    )
    tokens, _ = asyncio.run(decoded_ids(_engine(runner), request))
    return Generation(tokens, runner.prefill(parts, policy))
