"""A deterministic, model-free `ServeEngine` for fast HTTP tests (Encoder and LLM-worker
replicas, or in-process tests; `engine.kind: fake`), after Ray Serve LLM's `MockVLLMEngine`.

It runs the serving path end to end (uploads are identified, entries are content-addressed,
written to the store and loaded back through the tiers, multi-turn conversations are rendered
into parts) without a model: an image's entry is T = 8..15 zero "tokens" derived from its hash,
and the answer echoes the last user message's words. Decoding goes through the same `Sampler`
and `StopMatcher` as the reference engine, over logits that strongly prefer the echo: greedy
(temperature 0) gives exactly the echo and then EOS ("stop"), sampling with a seed gives the same
text for the same seed, `top_p`, penalties, `stop`, `logprobs` and `max_tokens` all act.

Token accounting: a text turn costs 4 tokens plus one per word, an image its entry's T;
`cached_tokens` counts the tokens of stored (not inline) entries, as the real engines do for the
`full`-free policies.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator

import torch

from mpic.addressing import entry_address
from mpic.deployments.config import EngineConfig
from mpic.deployments.engines.engine import Role, ServeEngine
from mpic.deployments.engines.prompting import identify_image
from mpic.deployments.messages import DoneEvent, EncodedImage, LinkedPrompt, TokenEvent
from mpic.engine.detokenize import StopMatcher
from mpic.engine.sampling import Sampler
from mpic.errors import InvalidRequestError
from mpic.storage.config import StorageConfig
from mpic.types import CacheEntry

FAKE_VOCAB = tuple(
    "the a cat dog red blue green image shows left right top bottom and of with is on".split()
)
"""Words every fake vocabulary holds besides the prompt's own (what sampling may pick)."""
EOS = "<eos>"
ECHO_BONUS = 3.0
"""How much the fake logits prefer the next echo word (greedy always picks it)."""
CONTEXT_LIMIT = 4096


def fake_tokens(media: bytes) -> int:
    """T of an image's fake entry: 8..15, from its bytes."""
    return 8 + hashlib.sha256(media).digest()[0] % 8


class FakeServeEngine(ServeEngine):
    """Echo engine: deterministic, no model, no GPU (see the module docstring)."""

    def __init__(self, cfg: EngineConfig, store: StorageConfig, role: Role) -> None:
        self.cfg = cfg
        self._fingerprint = "fake-" + hashlib.sha256(cfg.model.encode()).hexdigest()[:16]
        self.generated = 0

    @property
    def fingerprint(self) -> str:
        """A fingerprint derived from the configured model name."""
        return self._fingerprint

    def encode_image(self, image_bytes: bytes) -> EncodedImage:
        """Validate (415 if not an image) and identify; no embeddings."""
        content_hash, media_type = identify_image(image_bytes)
        return EncodedImage(image_bytes, content_hash, media_type, None)

    def entry_id(self, media: bytes) -> str:
        """Content address over (fingerprint, an empty context, media bytes)."""
        return entry_address(self._fingerprint, [], media)

    def compute_entry(self, entry_id: str, image: EncodedImage) -> CacheEntry:
        """T zero keys/values ([1, T, 1, 2]) at positions 0..T-1."""
        t = fake_tokens(image.media)
        zeros = torch.zeros(1, t, 1, 2)
        return CacheEntry(
            entry_id=entry_id,
            model_fingerprint=self._fingerprint,
            keys=zeros,
            values=zeros.clone(),
            positions=torch.arange(t),
            input_embeds=torch.zeros(t, 2),
        )

    def context_length(self) -> int:
        """`max_model_len` when configured, else the fake context (4096)."""
        return int(getattr(self.cfg, "max_model_len", None) or CONTEXT_LIMIT)

    def engine_stats(self) -> dict[str, int]:
        """`generated`: answers produced by this replica."""
        return {"generated": self.generated}

    async def generate(
        self, prompt: LinkedPrompt, entries: dict[str, CacheEntry]
    ) -> AsyncIterator[TokenEvent | DoneEvent]:
        """Echo the last user message's words under `prompt.sampling`, then a DoneEvent."""
        start = time.perf_counter()
        prompt_tokens, cached, echo = 0, 0, []
        for turn in prompt.turns:
            prompt_tokens += 4
            for seg in turn.segments:
                if seg.kind == "text":
                    prompt_tokens += len(seg.text.split())
                elif seg.kind == "entry":
                    prompt_tokens += entries[seg.entry_id].num_tokens
                    cached += entries[seg.entry_id].num_tokens
                else:
                    prompt_tokens += fake_tokens(seg.embeds.media)
            if turn.role == "user":
                echo = [w for s in turn.segments if s.kind == "text" for w in s.text.split()]
        if prompt_tokens + prompt.max_tokens > CONTEXT_LIMIT:
            raise InvalidRequestError(
                f"prompt ({prompt_tokens} tokens) + max_tokens over the {CONTEXT_LIMIT}-token "
                "context",
                param="messages",
            )
        vocab = [EOS, *dict.fromkeys([*FAKE_VOCAB, *echo])]
        index = {w: i for i, w in enumerate(vocab)}
        sampler = Sampler(prompt.sampling, lambda i: vocab[i] if i else "")
        stops = StopMatcher(prompt.sampling.stop)
        base = torch.Generator().manual_seed(
            int.from_bytes(hashlib.sha256(" ".join(echo).encode()).digest()[:7], "big")
        )
        noise = torch.rand(len(vocab), generator=base)
        n, finish, first = 0, "length", None
        while n < prompt.max_tokens:
            logits = noise.clone()
            logits[index[echo[n]] if n < len(echo) else 0] += ECHO_BONUS
            token = sampler(logits)
            n += 1
            if token == 0 and not prompt.sampling.ignore_eos:
                finish = "stop"
                break
            word = vocab[token] if token else ""  # EOS decoded past (ignore_eos): no text
            piece, stopped = stops.push(word if n == 1 or not word else " " + word)
            if self.cfg.fake_token_delay_s:
                await asyncio.sleep(self.cfg.fake_token_delay_s)
            else:
                await asyncio.sleep(0)
            first = first if first is not None else time.perf_counter() - start
            yield TokenEvent(piece, sampler.take())
            if stopped:
                finish = "stop"
                break
        if rest := stops.flush():
            yield TokenEvent(rest)
        self.generated += 1
        yield DoneEvent(
            prompt_tokens=prompt_tokens,
            cached_tokens=cached,
            completion_tokens=n,
            finish_reason=finish,
            ttft_s=first if first is not None else time.perf_counter() - start,
        )
