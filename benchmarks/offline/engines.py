"""The engines `mpic bench offline` drives (CLI process): any `mpic.engine.protocol.Engine`,
built by name (`get_engine`; `register_engine` adds a name), and `Driver`, the benchmark's
requests to one through the protocol alone.

- `reference`: `mpic.engine.hf.engine.ReferenceEngine` over a `ReferenceRunner` (float32 on
  the CPU unless a device and dtype are given);
- `vllm`: `mpic.engine.vllm.async_engine.AsyncVllmEngine` (vLLM + the MPIC connector, float32
  on the CPU, a fresh file store, full-vocabulary logprobs for the KL).

`Driver` caches images (`Engine.cache_image`: entries in memory before timing starts), times
one prompt's first token under a policy (`Engine.decode` of a 1-token request: TTFT is the
backend's `Prefill.ttft_s`, from the request to its first token, planning included; the CPU
time is this process's over the request plus, for a backend whose model runs elsewhere
(`worker_cpu_s`), that of those processes), scores its first-token distribution (an untimed
request with `capture_first_token`) and decodes 16 greedy tokens
(`mpic.engine.request_flow.decoded_ids`, `Sampling(ignore_eos=True)`). `full` and `prefix` go
out as `plain` requests: vLLM runs them as plain vLLM (its own baselines, docs/vllm.md
"Benchmark"); the reference runner, which has no other path, runs them as policies. On a
backend with its own prefix cache (`prefix_cache`) each timed `full` request gets a fresh
`cache_salt` (no reuse) and each timed `prefix` one a new opening text (only the shared
system prompt can hit, MPIC paper Fig. 3). The floor, op-count and device hooks are the
protocol's optional members (`Engine`'s docstring), read with getattr. The compression benchmark
(`mpic.benchmarks.compress.rows.CompressBench`) drives both of its engines by the same `Driver`
(documents cached too, linked requests of any policy: `plain=False`, every step's distribution:
`GenerateRequest.capture_steps` collected by `Driver.run`, with each step's arrival time).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mpic.engine.protocol import Engine, GenerateRequest, Prefill, Sampling
from mpic.engine.request_flow import decoded_ids

if TYPE_CHECKING:
    from mpic.engine.first_token import FirstToken
    from mpic.engine.hf.engine import ReferenceEngine
    from mpic.linker.prompt import PromptPart
    from mpic.types import CacheEntry

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""`--dtype` names the reference engine accepts."""

PLAIN_POLICIES = ("full", "prefix")
"""Policies sent as `GenerateRequest.plain` (the backend's own exact baselines)."""


def reference_engine(
    model_dir: str, device: str = "cpu", dtype: str = "float32", attention: str | None = None
) -> ReferenceEngine:
    """The HF reference runner as an `Engine` (`ReferenceEngine`, its `runner` at hand).
    attention: the linked KV's attention backend (`mpic.kernels.attention`), None = by
    device."""
    from mpic.engine.hf.engine import ReferenceEngine
    from mpic.engine.hf.reference_runner import ReferenceRunner

    runner = ReferenceRunner(
        model_dir, device=device, dtype=DTYPES[dtype], attention_backend=attention
    )
    return ReferenceEngine(runner)


def _vllm_engine(model_dir: str) -> Engine:
    """vLLM + the MPIC connector (imported only when asked for: vLLM starts processes)."""
    from tempfile import mkdtemp

    from mpic.engine.vllm.async_engine import AsyncVllmEngine
    from mpic.engine.vllm.config import VllmEngineConfig
    from mpic.storage.config import StorageConfig

    store = StorageConfig(url=f"file://{mkdtemp(prefix='mpic-vllm-bench-')}", fsync=False)
    return AsyncVllmEngine(VllmEngineConfig(model=model_dir, max_logprobs=-1, storage=store))


_ENGINES: dict[str, Callable[[str], Engine]] = {
    "reference": reference_engine,
    "vllm": _vllm_engine,
}


def register_engine(name: str, factory: Callable[[str], Engine]) -> None:
    """Make `--engine name` build `factory(model_dir)`, any `Engine`."""
    _ENGINES[name] = factory


def get_engine(
    name: str,
    model_dir: str,
    device: str = "cpu",
    dtype: str = "float32",
    attention: str | None = None,
) -> Engine:
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
        return reference_engine(model_dir, device, dtype, attention)
    if (device, dtype, attention) != ("cpu", "float32", None):
        raise ValueError(
            f"--device/--dtype/--attention apply to the reference engine, not {name!r}"
        )
    return _ENGINES[name](model_dir)


@dataclass
class TimedRun:
    """One timed first token."""

    ttft_s: float
    """The backend's `Prefill.ttft_s`."""
    recomputed_tokens: int
    cpu_s: float
    """CPU seconds of this process over the request, plus the engine's `worker_cpu_s` share."""


def recomputed(prefill: Prefill) -> int:
    """The tokens a pass ran: the backend's count, else the prompt less its cached tokens."""
    if prefill.recomputed_tokens is not None:
        return prefill.recomputed_tokens
    return prefill.prompt_tokens - prefill.cached_tokens


def first_token_logits(first: FirstToken, vocab: int) -> torch.Tensor:
    """float32 [vocab] of a captured first token: its logits, or a logprobs backend's
    log-probs (-inf for the tokens it did not report; longer when it reports ids past
    `vocab`), which the KL softmaxes alike."""
    if first.logits is not None:
        return first.logits
    ids = torch.tensor(first.token_ids or [], dtype=torch.int64)
    out = torch.full((max(vocab, int(ids.max()) + 1 if len(ids) else 0),), float("-inf"))
    out[ids] = torch.tensor(first.logprobs or [], dtype=torch.float32)
    return out


class Driver:
    """The offline benchmark's requests to one `Engine` (module docstring): the images it
    cached and one event loop for its requests. Not an engine: every backend goes through the
    same code."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.entries: dict[str, CacheEntry] = {}
        self.media: dict[str, bytes] = {}
        """Each image's bytes, what a `plain` request prefills."""
        self._loop = asyncio.new_event_loop()

    def close(self) -> None:
        """Close the event loop and its threads (the engine stays up)."""
        self._loop.run_until_complete(self._loop.shutdown_default_executor())
        self._loop.close()

    def add_image(self, media: bytes) -> str:
        """Cache an image (`Engine.cache_image`; the entry stays in memory for this driver's
        requests); returns its entry id."""
        entry = self.engine.cache_image(media)
        self.entries[entry.entry_id] = entry
        self.media[entry.entry_id] = media
        return entry.entry_id

    def add_document(self, text: str) -> str:
        """Cache a text document (`Engine.cache_document`; the entry stays in memory for this
        driver's requests); returns its entry id."""
        entry = self.engine.cache_document(text)
        self.entries[entry.entry_id] = entry
        return entry.entry_id

    def request(
        self, parts: Sequence[PromptPart], policy: str, max_tokens: int = 1, **options: Any
    ) -> GenerateRequest:
        """A greedy request of `parts` under `policy`, exactly `max_tokens` long (no early
        stop); `full` and `prefix` plain (`PLAIN_POLICIES`, their images' media with them)
        unless `plain=False` says otherwise; `options`: more `GenerateRequest` fields."""
        plain = options.pop("plain", policy in PLAIN_POLICIES)
        return GenerateRequest(
            parts,
            self.entries,
            policy,
            Sampling(ignore_eos=True),
            max_tokens,
            media=self.media if plain else None,  # a linked run that cannot link fails loudly
            plain=plain,
            **options,
        )

    def run(
        self,
        request: GenerateRequest,
        captured: list[FirstToken] | None = None,
        stamps: list[float] | None = None,
    ) -> tuple[list[int], Prefill]:
        """`request`'s token ids and `Prefill` (`decoded_ids` on the driver's loop; `captured`
        collects each token's distribution when the request asks `capture_steps`, `stamps` the
        time each step arrived)."""
        return self._loop.run_until_complete(decoded_ids(self.engine, request, captured, stamps))

    def first_token(self, parts: Sequence[PromptPart], policy: str) -> TimedRun:
        """Time one first token (module docstring: salts and opening texts on a backend with
        its own prefix cache)."""
        salt = None
        if getattr(self.engine, "prefix_cache", False):
            if policy == "prefix":  # a new opening text each time (paper Fig. 3)
                parts = [f"({uuid.uuid4().hex[:8]}) {parts[0]}", *parts[1:]]
            elif policy == "full":
                salt = f"full-{uuid.uuid4().hex}"
        worker = getattr(self.engine, "worker_cpu_s", None)
        cpu0, worker0 = time.process_time(), worker() if worker else 0.0
        _, prefill = self.run(self.request(parts, policy, cache_salt=salt))
        cpu = time.process_time() - cpu0 + (worker() - worker0 if worker else 0.0)
        return TimedRun(prefill.ttft_s, recomputed(prefill), cpu)

    def scored(self, parts: Sequence[PromptPart], policy: str) -> tuple[torch.Tensor, Prefill]:
        """Untimed: the first-token distribution (`first_token_logits`, the whole vocabulary)
        of `parts` under `policy`, and the pass's `Prefill`."""
        request = self.request(parts, policy, capture_first_token=True, capture_top_k=-1)
        _, prefill = self.run(request)
        if prefill.first_token is None:
            raise ValueError(f"the engine captured no first-token distribution for {policy!r}")
        return first_token_logits(prefill.first_token, self.engine.spec.vocab_size), prefill

    def greedy(self, parts: Sequence[PromptPart], policy: str, max_new_tokens: int) -> list[int]:
        """Exactly `max_new_tokens` greedy tokens under `policy`."""
        ids, _ = self.run(self.request(parts, policy, max_new_tokens))
        return ids


def prefill_request(
    parts: Sequence[PromptPart], policy: str, entries: Mapping[str, CacheEntry] | None = None
) -> GenerateRequest:
    """The request an engine's `prefill_fn` runs untimed (op counts): `parts` under `policy`."""
    return GenerateRequest(parts, entries or {}, policy, Sampling(ignore_eos=True), 1)
