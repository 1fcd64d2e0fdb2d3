"""Picking the next token from logits by a request's `Sampling` (the process that decodes with
the reference runner: LLM-worker replica, benchmark, CLI; the fake engine's too). vLLM samples
natively with the same fields (`mpic.engine.vllm.frontend`)."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Sequence

import torch

from mpic.engine.protocol import Sampling, TokenLogprob
from mpic.errors import InvalidRequestError


def stop_ids(stop_token_ids: Sequence[int], end_ids: Sequence[int], ignore_eos: bool) -> list[int]:
    """The ids that end an answer, vLLM's rule (both engines' text layer, and the ids the vLLM
    engine hands vLLM): the request's `stop_token_ids`, then the model's end ids unless
    `ignore_eos` (vLLM checks `stop_token_ids` even with `ignore_eos`). `min_tokens` holds
    back these and, with `ignore_eos` too, the end ids (`Sampler`'s `end_ids`)."""
    ends = [] if ignore_eos else [i for i in end_ids if i not in stop_token_ids]
    return [*stop_token_ids, *ends]


class Sampler:
    """Picks the next token from logits [V] by a request's `Sampling`, in vLLM's order:
    `logit_bias` is added; while fewer than `min_tokens` tokens are generated the end ids
    (`end_ids`) get -inf; the repetition penalty divides the positive logits (multiplies the
    negative ones) of every token in `prompt_ids` or generated so far; frequency/presence
    penalties subtract `frequency * count + presence * (count > 0)` from the logits of tokens
    generated so far (OpenAI's definition). Temperature 0 is greedy (argmax); else
    softmax(logits / temperature), then `min_p`, `top_k` and `top_p` (the smallest nucleus of
    what is left, renormalised), drawn with a torch Generator seeded per request (same seed,
    same text). Logprobs are log-softmax of the processed logits at temperature 1 (`token_text`
    names the tokens then; `token_bytes` gives their raw bytes, `mpic.engine.token_bytes`).

    prompt_ids: the prompt's token ids (the repetition penalty's; set once the prompt is
    planned, before the first pick); end_ids: the ids `min_tokens` holds back (the model's end
    ids and the request's `stop_token_ids`, in the caller's id space)."""

    def __init__(
        self,
        sampling: Sampling,
        token_text: Callable[[int], str] | None = None,
        token_bytes: Callable[[int], bytes] | None = None,
        prompt_ids: Iterable[int] = (),
        end_ids: Iterable[int] = (),
    ) -> None:
        self.s, self.token_text, self.token_bytes = sampling, token_text or str, token_bytes
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        self.gen = torch.Generator().manual_seed(seed)
        self.counts: dict[int, int] = {}
        self.pending: list[TokenLogprob] = []
        self.prompt_ids = set(prompt_ids)
        self.end_ids = list(end_ids)

    def processed(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 [V] on the host: `logits` after the bias, `min_tokens` and the penalties
        (the class docstring's order, vLLM's), what greedy picks from and logprobs report."""
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
        if s.min_tokens and self.end_ids and sum(self.counts.values()) < s.min_tokens:
            logits[torch.tensor(self.end_ids)] = float("-inf")
        if s.repetition_penalty != 1.0 and (self.prompt_ids or self.counts):
            seen = torch.tensor(sorted(self.prompt_ids | self.counts.keys()))
            seen = seen[seen < logits.numel()]
            hit = logits[seen]
            logits[seen] = torch.where(
                hit > 0, hit / s.repetition_penalty, hit * s.repetition_penalty
            )
        if self.counts and (s.frequency_penalty or s.presence_penalty):
            ids = torch.tensor(list(self.counts))
            n = torch.tensor(list(self.counts.values()), dtype=torch.float32)
            logits[ids] -= s.frequency_penalty * n + s.presence_penalty
        return logits

    def __call__(self, logits: torch.Tensor, forced: int | None = None) -> int:
        """The next token id; `forced` (teacher forcing, `GenerateRequest.forced_ids`) is taken
        instead of a draw, its penalties counted and its logprob reported."""
        s, logits = self.s, self.processed(logits)
        if forced is not None:
            token = forced
        elif s.temperature <= 0:
            token = int(logits.argmax())
        else:
            probs = torch.softmax(logits / s.temperature, dim=-1)
            if s.min_p > 0:
                probs[probs < s.min_p * probs.max()] = 0
            if 0 < s.top_k < probs.numel():
                probs[probs.topk(probs.numel() - s.top_k, largest=False)[1]] = 0
            if s.top_p < 1:
                probs /= probs.sum()
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
