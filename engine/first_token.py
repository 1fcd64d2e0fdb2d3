"""A pass's first-token distribution as the serve engines capture it (LLM-worker replica) and
how two of them compare: the live fidelity monitor (`mpic.deployments.monitoring
.fidelity_monitor`) compares the served pass's with a shadow exact pass's.

The reference engine captures the full logits [V]; vLLM returns logprobs, not logits, so its
served pass asks for its top-`TOP_K` raw logprobs and the shadow for the exact logprobs of those
token ids (`compare`'s `topk` kind).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

TOP_K = 20
"""Top-k logprobs a vLLM served pass captures (the `topk` KL runs over them)."""


@dataclass
class FirstToken:
    """One pass's first-token distribution: full logits, or top-k logprobs (vLLM)."""

    top1: int
    """The most likely first token (argmax of the logits / rank-1 logprob)."""
    logits: torch.Tensor | None = None
    """float32 [V] of the last prompt position (reference engine), else None."""
    token_ids: list[int] | None = None
    """Top-k kind: the token ids of `logprobs` (vLLM)."""
    logprobs: list[float] | None = None
    """Top-k kind: log-probabilities of `token_ids` under the full softmax."""
    answer: list[int] | None = None
    """The pass's answer tokens, first one included (the served pass's whole answer, set by
    `mpic.engine.request_flow.generate`; an exact shadow's greedy continuation when asked for);
    None when not captured."""

    @classmethod
    def from_logits(cls, logits: torch.Tensor) -> FirstToken:
        """Full kind, from logits [V] (copied to CPU float32)."""
        logits = logits.detach().float().cpu().reshape(-1)
        return cls(top1=int(logits.argmax()), logits=logits)

    @classmethod
    def from_logprobs(cls, step: dict[int, Any], k: int) -> FirstToken:
        """Top-k kind, from one vLLM step {token id: Logprob(logprob, rank)}: the entries of
        rank <= k (vLLM adds the sampled token when it ranks lower)."""
        top = sorted(
            ((tid, lp) for tid, lp in step.items() if lp.rank is None or lp.rank <= k),
            key=lambda kv: kv[1].rank if kv[1].rank is not None else math.inf,
        )
        return cls(
            top1=int(top[0][0]),
            token_ids=[int(t) for t, _ in top],
            logprobs=[float(lp.logprob) for _, lp in top],
        )


def compare(exact: FirstToken, served: FirstToken) -> tuple[float, bool, Literal["full", "topk"]]:
    """(KL(exact || served), top-1 agreement, kind). Both full: the full-vocabulary KL in
    float64 (`mpic bench fidelity`'s formula). Served top-k: KL of the two distributions
    renormalised over the served token ids, which `exact` must carry (in any order)."""
    import torch

    agree = exact.top1 == served.top1
    if exact.logits is not None and served.logits is not None:
        p = torch.log_softmax(exact.logits.double(), -1)
        q = torch.log_softmax(served.logits.double(), -1)
        return max(0.0, float((p.exp() * (p - q)).sum())), agree, "full"
    if served.token_ids is None or served.logprobs is None:
        raise ValueError("the served pass carries neither logits nor top-k logprobs")
    if exact.logits is not None:
        exact_lp = torch.log_softmax(exact.logits.double(), -1)[served.token_ids].tolist()
    else:
        table = dict(zip(exact.token_ids or [], exact.logprobs or [], strict=True))
        missing = [t for t in served.token_ids if t not in table]
        if missing:
            raise ValueError(f"the exact pass lacks logprobs of served top-k tokens {missing}")
        exact_lp = [table[t] for t in served.token_ids]
    p = torch.log_softmax(torch.tensor(exact_lp, dtype=torch.float64), -1)
    q = torch.log_softmax(torch.tensor(served.logprobs, dtype=torch.float64), -1)
    return max(0.0, float((p.exp() * (p - q)).sum())), agree, "topk"
