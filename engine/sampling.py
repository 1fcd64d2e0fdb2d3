"""Picking the next token from logits by a request's `Sampling` (the process that decodes with
the reference runner: LLM-worker replica, benchmark, CLI; the fake engine's too). vLLM samples
natively with the same fields (`mpic.engine.vllm.frontend`)."""

from __future__ import annotations

import secrets
from collections.abc import Callable

import torch

from mpic.engine.protocol import Sampling, TokenLogprob
from mpic.errors import InvalidRequestError


class Sampler:
    """Picks the next token from logits [V] by a request's `Sampling`. `logit_bias` is added
    first; then frequency/presence penalties subtract `frequency * count + presence * (count >
    0)` from the logits of tokens generated so far (OpenAI's definition); temperature 0 is
    greedy (argmax), else softmax(logits / temperature) restricted to the smallest top-p
    nucleus, drawn with a torch Generator seeded per request (same seed, same text). Logprobs
    are log-softmax of the biased, penalised logits at temperature 1 (`token_text` names the
    tokens then; `token_bytes` gives their raw bytes, `mpic.engine.token_bytes`)."""

    def __init__(
        self,
        sampling: Sampling,
        token_text: Callable[[int], str] | None = None,
        token_bytes: Callable[[int], bytes] | None = None,
    ) -> None:
        self.s, self.token_text, self.token_bytes = sampling, token_text or str, token_bytes
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        self.gen = torch.Generator().manual_seed(seed)
        self.counts: dict[int, int] = {}
        self.pending: list[TokenLogprob] = []

    def __call__(self, logits: torch.Tensor, forced: int | None = None) -> int:
        """The next token id; `forced` (teacher forcing, `GenerateRequest.forced_ids`) is taken
        instead of a draw, its penalties counted and its logprob reported."""
        s, logits = self.s, logits.detach().float().cpu().clone()
        if s.logit_bias:
            ids = torch.tensor(list(s.logit_bias))
            if int(ids.max()) >= logits.numel():
                raise InvalidRequestError(
                    f"logit_bias: token id {int(ids.max())} is outside the vocabulary "
                    f"({logits.numel()} tokens)",
                    param="logit_bias",
                )
            logits[ids] += torch.tensor(list(s.logit_bias.values()))
        if self.counts and (s.frequency_penalty or s.presence_penalty):
            ids = torch.tensor(list(self.counts))
            n = torch.tensor(list(self.counts.values()), dtype=torch.float32)
            logits[ids] -= s.frequency_penalty * n + s.presence_penalty
        if forced is not None:
            token = forced
        elif s.temperature <= 0:
            token = int(logits.argmax())
        else:
            probs = torch.softmax(logits / s.temperature, dim=-1)
            if s.top_p < 1:
                sorted_p, order = probs.sort(descending=True)
                outside = (sorted_p.cumsum(0) - sorted_p) >= s.top_p
                probs[order[outside]] = 0
            token = int(torch.multinomial(probs, 1, generator=self.gen))
        self.counts[token] = self.counts.get(token, 0) + 1
        if s.logprobs is not None:
            logp = torch.log_softmax(logits, dim=-1)
            top = logp.topk(min(s.logprobs, logp.numel())) if s.logprobs else None
            ids = [int(i) for i in top[1]] if top is not None else []
            alts = [(self.token_text(i), float(logp[i])) for i in ids]
            raw = self.token_bytes
            self.pending.append(
                TokenLogprob(
                    self.token_text(token),
                    float(logp[token]),
                    alts,
                    raw(token) if raw else None,
                    [raw(i) for i in ids] if raw else None,
                )
            )
        return token

    def take(self) -> list[TokenLogprob] | None:
        """The logprobs of the tokens picked since the last call (None unless asked for)."""
        if self.s.logprobs is None:
            return None
        out, self.pending = self.pending, []
        return out
