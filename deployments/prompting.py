"""Engine-independent steps of serving (Encoder and LLM-worker replicas): identifying an
uploaded image, chat turns -> the linker's prompt parts, generated token ids -> streamed text,
and the linked-token count that `usage.prompt_tokens_details.cached_tokens` reports. Both
`ServeEngine`s use them.
"""

from __future__ import annotations

import hashlib
import io
import secrets
from collections.abc import Callable, Iterable, Iterator

import torch

from mpic.deployments.messages import (
    EncodedImage,
    LinkedPrompt,
    Sampling,
    TokenEvent,
    TokenLogprob,
)
from mpic.engine.hf.vision import load_image
from mpic.errors import InvalidRequestError
from mpic.prompt_parts import DocumentRef, ImageRef, PromptPart, Turn
from mpic.types import LinkPlan

INLINE_PREFIX = "inline-"
"""Entry ids of inline images (computed for one request, never from the store)."""


def identify_image(media: bytes) -> tuple[str, str]:
    """(sha256 hex, MIME type) of an image; UnreadableMediaError (415) if it does not decode."""
    from PIL import Image

    load_image(media)
    with Image.open(io.BytesIO(media)) as img:
        return hashlib.sha256(media).hexdigest(), f"image/{(img.format or 'unknown').lower()}"


def prompt_parts(
    prompt: LinkedPrompt, system_prompt: str | None, inline_entry: Callable[[EncodedImage], str]
) -> tuple[str | None, list[PromptPart]]:
    """(system prompt, parts) of a conversation: the first system (or developer) message is the
    system prompt (default `system_prompt`); every other message starts with a `Turn(role)`
    part followed by its text strings and ImageRefs, so the chat template renders each turn
    with its own role and the images of every turn are linked where they now stand (MPIC is
    position-independent: a follow-up question reuses the KV of earlier turns' images).
    `inline_entry(image)` makes an inline image linkable and returns its entry id."""
    parts: list[PromptPart] = []
    for i, turn in enumerate(prompt.turns):
        role = "system" if turn.role == "developer" else turn.role
        if role == "system" and i == 0:
            system_prompt = "".join(s.text for s in turn.segments)
            continue
        parts.append(Turn(role))
        for seg in turn.segments:
            if seg.kind == "text":
                parts.append(seg.text)
            elif seg.kind == "inline":
                parts.append(ImageRef(inline_entry(seg.embeds)))
            elif seg.document:
                parts.append(DocumentRef(seg.entry_id))
            else:
                parts.append(ImageRef(seg.entry_id))
    if parts and parts[0] == Turn("user") and not any(isinstance(p, Turn) for p in parts[1:]):
        parts = parts[1:]  # one user message: the plain prompt (offline runner's rendering)
    return system_prompt, parts


class StopMatcher:
    """OpenAI `stop` strings over streamed text: `push(piece)` gives the text that is safe to
    send (a suffix that may begin a stop string is held back) and whether a stop string
    matched (the text from it on is dropped); `flush()` gives what was held back."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.held, self.stopped = [s for s in stops if s], "", False

    def push(self, piece: str) -> tuple[str, bool]:
        """(text to emit, stopped)."""
        if self.stopped:
            return "", True
        text = self.held + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held, self.stopped = "", True
            return text[: min(hits)], True
        keep = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    keep = max(keep, k)
                    break
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The held-back text (no stop string matched)."""
        rest, self.held = self.held, ""
        return "" if self.stopped else rest


class Sampler:
    """Picks the next token from logits [V] by a request's `Sampling` (the reference and fake
    engines; vLLM samples natively with the same fields). `logit_bias` is added first; then
    frequency/presence penalties subtract `frequency * count + presence * (count > 0)` from the
    logits of tokens generated so far (OpenAI's definition); temperature 0 is greedy, else
    softmax(logits / temperature) restricted to the smallest top-p nucleus, drawn with a torch
    Generator seeded per request (same seed, same text). Logprobs are log-softmax of the
    biased, penalised logits at temperature 1."""

    def __init__(
        self,
        sampling: Sampling,
        token_text: Callable[[int], str],
        token_bytes: Callable[[int], bytes] | None = None,
    ) -> None:
        self.s, self.token_text, self.token_bytes = sampling, token_text, token_bytes
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        self.gen = torch.Generator().manual_seed(seed)
        self.counts: dict[int, int] = {}
        self.pending: list[TokenLogprob] = []

    def __call__(self, logits: torch.Tensor) -> int:
        """The next token id."""
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
        if s.temperature <= 0:
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


class Detokenizer:
    """Incremental detokenization: `push(tokens)` gives the text the new tokens add, holding
    back text that ends in an incomplete character (U+FFFD until its bytes are all decoded);
    `flush()` gives the rest. The pieces join to the decoded text of all tokens."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.text, self.tokens = tokenizer, "", []

    def push(self, tokens: Iterable[int]) -> TokenEvent:
        """The TokenEvent of `tokens` (text may be empty while a character is incomplete)."""
        self.tokens.extend(tokens)
        full = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if full.endswith("\ufffd"):
            return TokenEvent("")
        piece, self.text = full[len(self.text) :], full
        return TokenEvent(piece)

    def flush(self) -> TokenEvent:
        """The text held back so far."""
        full = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        piece, self.text = full[len(self.text) :], full
        return TokenEvent(piece)


def token_events(tokenizer, tokens: Iterable[int]) -> Iterator[TokenEvent]:
    """One TokenEvent per token as it arrives (`Detokenizer`), then any held-back text."""
    detok = Detokenizer(tokenizer)
    for token in tokens:
        yield detok.push([token])
    if (rest := detok.flush()).text:
        yield rest


def stored_linked_tokens(plan: LinkPlan) -> int:
    """Prompt tokens served from STORED entries at every layer (recompute depth 0; inline images
    excluded). Tokens a policy recomputes at some layers (VLCache's partial depths, CacheBlend's
    check layers) ran through the model and do not count."""
    stored = torch.tensor([not e.startswith(INLINE_PREFIX) for e in plan.entry_ids] + [False])
    return int(((plan.recompute_depth == 0) & stored[plan.source_entry]).sum())
