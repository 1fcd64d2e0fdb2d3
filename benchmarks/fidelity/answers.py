"""A policy's greedy answer as the fidelity benchmarks score it (`bench`, `task`, the noise
floors), asked of any `mpic.engine.protocol.Engine` through the offline benchmark's `Driver`
(`Answers`): one greedy request, stopping after an end id, that captures the distribution its
first token was picked from (`GenerateRequest.capture_first_token`); with exact decoding the
engines' own two-pass flow (`GenerateRequest.exact_decode`,
`mpic.engine.request_flow.decode_steps`: the policy's first token, then decoding over the
prompt's exact KV; the distribution, prompt and recomputed tokens stay the policy's pass's)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads inside the command so `mpic --help` stays fast
    import torch

    from mpic.engine.protocol import Engine, Prefill
    from mpic.prompt_parts import PromptPart


@dataclass
class Answer:
    """A greedy answer and the pass its first token came from."""

    tokens: list[int]
    """The answer's token ids (the end id that ended it included)."""
    logits: torch.Tensor
    """float32 [V]: the first token's distribution (`first_token_logits`), what KL scores."""
    prefill: Prefill
    """The policy's pass: prompt and recomputed tokens, TTFT, the scouting cost (`scout`)."""

    @property
    def recomputed_fraction(self) -> float:
        """Tokens the pass ran through at least one layer / prompt tokens."""
        from mpic.benchmarks.offline.engines import recomputed

        return recomputed(self.prefill) / self.prefill.prompt_tokens


def engine_of(engine: Any) -> Engine:
    """`engine` as given, or a bare reference runner (no `decode`: callers sharing one, such as
    the tests' session runner) as its `mpic.engine.hf.engine.ReferenceEngine`."""
    if hasattr(engine, "decode"):
        return engine
    from mpic.engine.hf.engine import ReferenceEngine

    return ReferenceEngine(engine)


class Answers:
    """One engine's greedy answers over the items cached through it (module docstring)."""

    def __init__(self, engine: Any) -> None:
        from mpic.benchmarks.offline.engines import Driver

        self.engine = engine_of(engine)
        self.driver = Driver(self.engine)

    def add_document(self, text: str) -> str:
        """Cache a text document (`Engine.cache_document`); its entry id."""
        return self.driver.add_document(text)

    def add_image(self, media: bytes) -> str:
        """Cache an image (`Engine.cache_image`); its entry id."""
        return self.driver.add_image(media)

    def answer(
        self,
        parts: Sequence[PromptPart],
        policy: str,
        max_tokens: int,
        exact_decode: bool = False,
    ) -> Answer:
        """The greedy answer of `parts` under `policy` (at most `max_tokens` tokens, an end id
        included) with the pass its first token came from; `exact_decode`: the tokens after the
        first are decoded over the exact KV (`GenerateRequest.exact_decode`)."""
        from mpic.benchmarks.offline.engines import first_token_logits
        from mpic.engine.protocol import GenerateRequest

        request = GenerateRequest(
            parts,
            self.driver.entries,
            policy,
            max_tokens=max_tokens,
            capture_first_token=True,
            capture_top_k=-1,
            exact_decode=exact_decode,
        )
        tokens, prefill = self.driver.run(request)
        if prefill.first_token is None:
            raise ValueError(f"the engine captured no first-token distribution for {policy!r}")
        logits = first_token_logits(prefill.first_token, self.engine.spec.vocab_size)
        return Answer(tokens, logits, prefill)

    def close(self) -> None:
        """Close the driver's event loop (the engine stays up)."""
        self.driver.close()
