"""A request's `Sampling` in vLLM's terms, and vLLM's logprobs back in the engines' terms (the
process that owns the vLLM engine: Serve LLM-worker replica, CLI). vLLM samples natively with
every field; stop strings are cut by `mpic.engine.request_flow.TextStream`, as for the
reference runner."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mpic.engine.protocol import Sampling, TokenLogprob
from mpic.errors import InvalidRequestError


def sampling_kwargs(s: Sampling, vocab: int) -> dict[str, Any]:
    """vLLM `SamplingParams` keywords of `s`; InvalidRequestError for a `logit_bias` token id
    outside the vocabulary of `vocab` tokens."""
    if s.logit_bias and max(s.logit_bias) >= vocab:
        raise InvalidRequestError(
            f"logit_bias: token id {max(s.logit_bias)} is outside the vocabulary ({vocab} tokens)",
            param="logit_bias",
        )
    return {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "seed": s.seed,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "logit_bias": dict(s.logit_bias) or None,
        "logprobs": s.logprobs,
        "ignore_eos": s.ignore_eos,
        "top_k": max(s.top_k, 0),
        "min_p": s.min_p,
        "repetition_penalty": s.repetition_penalty,
        "min_tokens": s.min_tokens,
        "stop_token_ids": list(s.stop_token_ids) or None,
    }


def token_logprobs(
    steps: list[dict],
    tokens: list[int],
    k: int,
    text: Callable[[list[int]], str],
    raw: Callable[[int], bytes],
) -> list[TokenLogprob]:
    """TokenLogprobs of `tokens` from vLLM's per-step {token id: Logprob} dicts: the top `k`
    by vLLM's rank, named by `text` (the tokenizer's decode) with their own bytes (`raw`,
    `mpic.engine.token_bytes`: a byte token's own byte, not U+FFFD's UTF-8)."""
    out = []
    for step, token in zip(steps, tokens, strict=False):
        top = sorted(step.items(), key=lambda kv: kv[1].rank)[:k]
        out.append(
            TokenLogprob(
                text([token]),
                float(step[token].logprob),
                [(text([i]), float(lp.logprob)) for i, lp in top],
                raw(token),
                [raw(i) for i, _ in top],
            )
        )
    return out
