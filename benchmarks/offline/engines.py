"""Engines the offline benchmark can drive, by name (CLI process): thin adapters over a backend
of `mpic.engine.protocol.Engine`. `reference` is the HF reference runner; other engines (e.g.
`vllm`, `mpic.benchmarks.offline.vllm_engine`) register a factory with `register_engine`.

An engine caches images (entries in memory before timing starts), times one prompt's first
token under a policy, and decodes greedily. An engine that can also time a plain forward of S
tokens (`floor_s`) gives the benchmark its floor column: the least a selective pass over S
recomputed tokens could cost. An engine that runs its model in this process can also hand out
one prefill as a callable (`prefill_fn`), which the benchmark runs untimed to count its ops and
profile its kernels (`mpic.benchmarks.offline.op_counts`).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from mpic.benchmarks.offline.timed_prefill import TimedPrefill
from mpic.linker.prompt import PromptPart
from mpic.types import CacheEntry


class BenchEngine(Protocol):
    """What `mpic bench offline` needs from an engine.

    Optional members, read with getattr (an engine that runs its model in other processes,
    e.g. vLLM's, leaves them out and its rows get None):
    - `floor_s(num_tokens, repeats) -> float`: median seconds of a plain forward of that many
      tokens (the floor column);
    - `prefill_fn(parts, policy) -> Callable[[], object]`: a zero-argument callable running one
      first-token prefill of `parts` under `policy` in this process (op counts, GPU profile);
    - `num_layers: int`: the model's decoder layers (ops per layer);
    - `device: str`: where the model runs ("cpu" when absent; "cuda" gets two warm-ups).
    """

    name: str

    def cache_image(self, media: bytes) -> CacheEntry:
        """Compute the image's entry and keep it in memory (`Engine.cache_image`'s contract)."""
        ...

    def first_token(self, parts: Sequence[PromptPart], policy: str) -> TimedPrefill:
        """Prefill `parts` under `policy` and time the first token."""
        ...

    def greedy(self, parts: Sequence[PromptPart], policy: str, max_new_tokens: int) -> list[int]:
        """Exactly `max_new_tokens` greedy tokens (no early stop)."""
        ...


DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""`--dtype` names the reference engine accepts."""


class ReferenceBenchEngine:
    """The HF reference runner (float32 on CPU unless a device and dtype are given).

    attention: the linked KV's attention backend (`mpic.kernels.attention`), None = by device.
    """

    name = "reference"

    def __init__(
        self,
        model_dir: str,
        device: str = "cpu",
        dtype: str = "float32",
        attention: str | None = None,
    ) -> None:
        from mpic.engine.hf.engine import ReferenceEngine
        from mpic.engine.hf.reference_runner import ReferenceRunner

        self.runner = ReferenceRunner(
            model_dir, device=device, dtype=DTYPES[dtype], attention_backend=attention
        )
        self.engine = ReferenceEngine(self.runner)
        """The runner as the engine protocol's backend (`greedy` generates through it)."""

    @property
    def num_layers(self) -> int:
        """Decoder layers of the language model."""
        return self.runner.adapter.num_layers

    @property
    def device(self) -> str:
        """Device type the model runs on ("cpu", "cuda")."""
        return self.runner.model.device.type

    def cache_image(self, media: bytes) -> CacheEntry:
        """The cached image's entry."""
        return self.runner.cache_image(media)

    def first_token(self, parts: Sequence[PromptPart], policy: str) -> TimedPrefill:
        """Timed prefill (entries already in memory)."""
        out = self.runner.prefill(parts, policy)
        return TimedPrefill(
            out.ttft_s, out.logits, out.plan.num_tokens, out.recomputed_tokens, out.cpu_s
        )

    def prefill_fn(self, parts: Sequence[PromptPart], policy: str) -> Callable[[], object]:
        """One first-token prefill as `first_token` runs it, to call untimed."""
        return lambda: self.runner.prefill(parts, policy)

    def greedy(self, parts: Sequence[PromptPart], policy: str, max_new_tokens: int) -> list[int]:
        """Greedy tokens after the policy's prefill, generated through the engine protocol
        (`mpic.engine.hf.engine.ReferenceEngine.decode`, as the Serve engine generates)."""
        from mpic.engine.protocol import GenerateRequest, Sampling
        from mpic.engine.request_flow import decoded_ids

        request = GenerateRequest(
            parts, self.runner.entries, policy, Sampling(ignore_eos=True), max_new_tokens
        )
        ids, _ = asyncio.run(decoded_ids(self.engine, request))
        return ids

    @torch.inference_mode()
    def floor_s(self, num_tokens: int, repeats: int) -> float:
        """Median seconds of a plain HF forward of `num_tokens` text tokens through the language
        model (no cache, logits of the last token), after a warm-up: the floor of a selective
        pass that recomputes that many tokens."""
        model = self.runner.model
        vocab = int(model.config.text_config.vocab_size)
        ids = torch.randint(0, vocab, (1, num_tokens), generator=torch.Generator().manual_seed(0))
        ids = ids.to(model.device)
        lm = model.model.language_model

        def once() -> float:
            start = time.perf_counter()
            hidden = lm(input_ids=ids, use_cache=False).last_hidden_state
            int(model.lm_head(hidden[:, -1]).argmax())  # waits for the device
            return time.perf_counter() - start

        once()
        return statistics.median(once() for _ in range(repeats))


def _vllm_engine(model_dir: str) -> BenchEngine:
    """vLLM + the MPIC connector (imported only when asked for: vLLM starts processes)."""
    from mpic.benchmarks.offline.vllm_engine import VllmBenchEngine

    return VllmBenchEngine(model_dir)


_ENGINES: dict[str, Callable[[str], BenchEngine]] = {
    "reference": ReferenceBenchEngine,
    "vllm": _vllm_engine,
}


def register_engine(name: str, factory: Callable[[str], BenchEngine]) -> None:
    """Make `--engine name` build `factory(model_dir)`."""
    _ENGINES[name] = factory


def get_engine(
    name: str,
    model_dir: str,
    device: str = "cpu",
    dtype: str = "float32",
    attention: str | None = None,
) -> BenchEngine:
    """The engine called `name` over `model_dir`; ValueError listing valid names otherwise.

    device, dtype, attention: the reference engine's (ValueError for other engines, which take
    theirs from their own configuration, or for a CUDA device torch does not see)."""
    from mpic.kernels.attention import BACKENDS

    if name not in _ENGINES:
        raise ValueError(f"unknown engine {name!r}; valid: {', '.join(sorted(_ENGINES))}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    if attention is not None and attention not in BACKENDS:
        raise ValueError(f"unknown attention backend {attention!r}; valid: {', '.join(BACKENDS)}")
    try:
        kind = torch.device(device).type
    except RuntimeError as exc:
        raise ValueError(f"unknown device {device!r}: cpu or cuda") from exc
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but torch sees no CUDA device")
    if name == "reference":
        return ReferenceBenchEngine(model_dir, device, dtype, attention)
    if (device, dtype, attention) != ("cpu", "float32", None):
        raise ValueError(
            f"--device/--dtype/--attention apply to the reference engine, not {name!r}"
        )
    return _ENGINES[name](model_dir)
