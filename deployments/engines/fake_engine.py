"""A deterministic, model-free engine for fast HTTP tests (Encoder and LLM-worker replicas, or
in-process tests; `engine.kind: fake`), after Ray Serve LLM's `MockVLLMEngine`: `FakeEngine`
implements `mpic.engine.protocol.Engine` like the real backends (so generation runs through the
same `mpic.engine.request_flow.generate`: stop strings, detokenizing, finish reason, usage), and
`FakeServeEngine` is its `ServeEngine` adapter.

It runs the serving path end to end (uploads are identified, entries are content-addressed,
written to the store and loaded back through the tiers, multi-turn conversations are rendered
into parts) without a model: an image's entry is T = 8..15 zero "tokens" derived from its hash,
and the answer echoes the last user message's words. Tokens are words (`FakeTokenizer`; id 0 is
the end token); they are picked by the same `Sampler` as the reference engine's, over logits
that strongly prefer the echo: greedy (temperature 0) gives exactly the echo and then the end
token ("stop"), sampling with a seed gives the same text for the same seed, `top_p`, penalties,
`stop`, `logprobs` and `max_tokens` all act. `capture_first_token` reports the first step's
distribution over the prompt's vocabulary (`FirstToken`'s top-k kind, every word of it), so
tools that score first tokens (`mpic bench offline`) run on it too.

Token accounting: a text turn costs 4 tokens plus one per word, an image its entry's T;
`cached_tokens` counts the tokens of stored (not inline) entries, as the real engines do for the
`full`-free policies.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import torch

from mpic.addressing import entry_address
from mpic.deployments.config import EngineConfig
from mpic.deployments.engines.engine import Role, ServeEngine
from mpic.deployments.engines.prompting import INLINE_PREFIX, generate_request, identify_image
from mpic.deployments.messages import EncodedImage, LinkedPrompt
from mpic.engine.first_token import FirstToken
from mpic.engine.protocol import Decoded, GenerateRequest, Prefill
from mpic.engine.request_flow import EngineBase, continued
from mpic.engine.sampling import Sampler
from mpic.errors import InvalidRequestError, UnreadableMediaError
from mpic.linker.chat_template import ChatTemplateOptions
from mpic.linker.recipe import PlannedPrompt
from mpic.model_spec import ModelSpec, RopeSpec
from mpic.prompt_parts import DocumentRef, ImageRef, PromptPart, Turn
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


def fake_entry(entry_id: str, fingerprint: str, media: bytes) -> CacheEntry:
    """T zero keys/values ([1, T, 1, 2]) at positions 0..T-1 (T = `fake_tokens(media)`)."""
    t = fake_tokens(media)
    zeros = torch.zeros(1, t, 1, 2)
    return CacheEntry(
        entry_id=entry_id,
        model_fingerprint=fingerprint,
        keys=zeros,
        values=zeros.clone(),
        positions=torch.arange(t),
        input_embeds=torch.zeros(t, 2),
    )


class FakeTokenizer:
    """Words as tokens: id 0 is the end token, every other id a word, numbered as first seen."""

    def __init__(self) -> None:
        self.words, self.ids = [EOS], {EOS: 0}

    def id_of(self, word: str) -> int:
        """The id of `word` (a new one the first time)."""
        if word not in self.ids:
            self.ids[word] = len(self.words)
            self.words.append(word)
        return self.ids[word]

    def decode(
        self,
        ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        """The words of `ids` joined by spaces; the end token is special: dropped, or said
        (with no space around it unless `spaces_between_special_tokens`)."""
        kept = [i for i in ids if i or not skip_special_tokens]
        text = self.words[kept[0]] if kept else ""
        for before, i in zip(kept, kept[1:], strict=False):
            glued = not spaces_between_special_tokens and 0 in (before, i)
            text += ("" if glued else " ") + self.words[i]
        return text

    def __len__(self) -> int:
        return len(self.words)


class FakeEngine(EngineBase):
    """The echo backend of `Engine` (module docstring)."""

    def __init__(self, fingerprint: str, token_delay_s: float = 0.0) -> None:
        self.spec = ModelSpec(
            family="llama",
            path="",
            fingerprint=fingerprint,
            num_layers=0,
            num_heads=0,
            num_kv_heads=0,
            head_dim=0,
            hidden_size=0,
            vocab_size=0,
            max_model_len=CONTEXT_LIMIT,
            rope=RopeSpec(head_dim=0, theta=0.0),
            image_token_id=None,
            eos_token_ids=(0,),
        )
        self.tokenizer = FakeTokenizer()
        self.token_delay_s = token_delay_s
        self.generated = 0
        """Answers produced (decoded to their end)."""

    @property
    def processor(self) -> Any:
        """The word tokenizer (`FakeTokenizer`)."""
        return self.tokenizer

    def cache_image(self, media: bytes, system_prompt: str | None = None) -> CacheEntry:
        """The image's fake entry, named by its content address (415 if not an image)."""
        identify_image(media)
        return fake_entry(
            entry_address(self.spec.fingerprint, [], media), self.spec.fingerprint, media
        )

    def cache_document(self, text: str, system_prompt: str | None = None) -> CacheEntry:
        """415: the fake engine caches no documents."""
        raise UnreadableMediaError(
            "the FakeServeEngine engine does not cache text documents; serve with the "
            "reference or the vLLM engine",
            param="file",
        )

    def press_entry(self, entry: CacheEntry, press: str, budget: float) -> CacheEntry:
        """400: the fake engine compresses nothing."""
        raise InvalidRequestError("the fake engine has no presses", param="mpic.press")

    def plan(
        self,
        parts: Sequence[PromptPart],
        policy: Any = "full",
        max_new_tokens: int = 0,
        system_prompt: str | None = None,
        *,
        entries: Mapping[str, CacheEntry] | None = None,
        raw: bool = False,
        template: ChatTemplateOptions | None = None,
    ) -> PlannedPrompt:
        """400: the fake engine links without a plan (nothing is computed)."""
        raise InvalidRequestError("the fake engine makes no link plans")

    @staticmethod
    def _prompt(request: GenerateRequest) -> tuple[int, int, list[str]]:
        """(prompt tokens, cached tokens, the last user message's words) of `request`."""
        parts = request.parts
        turns = sum(isinstance(p, Turn) for p in parts)
        turns += bool(parts) and not isinstance(parts[0], Turn)  # one user message, unmarked
        words = 0
        if request.system_prompt is not None:
            turns, words = turns + 1, len(request.system_prompt.split())
        cached, linked, role, echo = 0, 0, "user", []
        for part in parts:
            if isinstance(part, Turn):
                role, echo = part.role, [] if part.role == "user" else echo
            elif isinstance(part, str):
                words += len(part.split())
                echo += part.split() if role == "user" else []
            elif isinstance(part, ImageRef | DocumentRef):
                n = request.entries[part.entry_id].num_tokens
                linked += n
                cached += 0 if part.entry_id.startswith(INLINE_PREFIX) else n
        return 4 * turns + words + linked, cached, echo

    async def decode(self, request: GenerateRequest) -> AsyncIterator[Decoded]:
        """Echo the last user message's words under `request.sampling`, one word per step (no
        teacher forcing: InvalidRequestError for `forced_ids`)."""
        if request.forced_ids:
            raise InvalidRequestError("the fake engine cannot teacher-force (forced_ids)")
        start = time.perf_counter()
        prompt_tokens, cached, echo = self._prompt(request)
        if prompt_tokens + request.max_tokens > CONTEXT_LIMIT:
            raise InvalidRequestError(
                f"prompt ({prompt_tokens} tokens) + max_tokens over the {CONTEXT_LIMIT}-token "
                "context",
                param="messages",
            )
        vocab = [EOS, *dict.fromkeys([*FAKE_VOCAB, *echo])]
        index = {w: i for i, w in enumerate(vocab)}
        ids = [self.tokenizer.id_of(w) for w in vocab]
        sampler = Sampler(
            request.sampling,
            lambda i: vocab[i] if i else "",
            prompt_ids=[index[w] for w in echo],  # its prompt's words, as its vocabulary's ids
            end_ids=[0, *(ids.index(t) for t in request.sampling.stop_token_ids if t in ids)],
        )
        base = torch.Generator().manual_seed(
            int.from_bytes(hashlib.sha256(" ".join(echo).encode()).digest()[:7], "big")
        )
        noise = torch.rand(len(vocab), generator=base)
        prefill = None
        done = len(continued(request))  # a continuation's words were already echoed
        for n in range(done, done + request.max_tokens):
            logits = noise.clone()
            logits[index[echo[n]] if n < len(echo) else 0] += ECHO_BONUS
            captured = None
            if prefill is None and request.capture_first_token:  # before the sampler's biases
                top1, logprobs_all = ids[int(logits.argmax())], torch.log_softmax(logits, -1)
                captured = FirstToken(top1, token_ids=ids, logprobs=logprobs_all.tolist())
            token = sampler(logits)
            ended = token == 0 and not request.sampling.ignore_eos
            logprobs = sampler.take()  # the end token's are not reported
            await asyncio.sleep(0 if ended else self.token_delay_s)
            first = prefill is None
            if first:
                ttft = time.perf_counter() - start
                prefill = Prefill(prompt_tokens, cached, ttft, first_token=captured)
            if ended or n == done + request.max_tokens - 1:  # counted before its last token:
                self.generated += 1  # the flow closes it at an end token (a stop token)
            yield Decoded([ids[token]], None if ended else logprobs, prefill if first else None)
            if ended:
                break


class FakeServeEngine(ServeEngine):
    """Echo engine: deterministic, no model, no GPU (see the module docstring)."""

    def __init__(self, cfg: EngineConfig, store: StorageConfig, role: Role) -> None:
        self.cfg = cfg
        fingerprint = "fake-" + hashlib.sha256(cfg.model.encode()).hexdigest()[:16]
        self.engine = FakeEngine(fingerprint, cfg.fake_token_delay_s or 0.0)

    @property
    def backend(self) -> FakeEngine:
        """The echo backend."""
        return self.engine

    @property
    def fingerprint(self) -> str:
        """A fingerprint derived from the configured model name."""
        return self.engine.spec.fingerprint

    def encode_image(self, image_bytes: bytes) -> EncodedImage:
        """Validate (415 if not an image) and identify; no embeddings."""
        content_hash, media_type = identify_image(image_bytes)
        return EncodedImage(image_bytes, content_hash, media_type, None)

    def entry_id(self, media: bytes) -> str:
        """Content address over (fingerprint, an empty context, media bytes)."""
        return entry_address(self.fingerprint, [], media)

    def compute_entry(self, entry_id: str, image: EncodedImage) -> CacheEntry:
        """T zero keys/values ([1, T, 1, 2]) at positions 0..T-1."""
        return fake_entry(entry_id, self.fingerprint, image.media)

    def context_length(self) -> int:
        """`max_model_len` when configured, else the fake context (4096)."""
        return int(getattr(self.cfg, "max_model_len", None) or CONTEXT_LIMIT)

    def engine_stats(self) -> dict[str, int]:
        """`generated`: answers produced by this replica."""
        return {"generated": self.engine.generated}

    def request_of(self, prompt: LinkedPrompt, entries: dict[str, CacheEntry]) -> GenerateRequest:
        """The backend's request (the conversation's own system prompt only; inline images'
        fake entries for this request alone)."""

        def inline_entry(image: EncodedImage) -> CacheEntry:
            return self.compute_entry(INLINE_PREFIX + image.content_hash, image)

        return generate_request(prompt, None, entries, inline_entry)
