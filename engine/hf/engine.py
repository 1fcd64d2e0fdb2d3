"""The reference backend of `mpic.engine.protocol.Engine` (any process that serves or benchmarks
the HF reference runner asynchronously: the Serve LLM worker with `engine.kind: reference`,
tests): one `ReferenceRunner` shared by threads under one lock, its generation decoded on a
thread of its own per request.

`decode` runs the runner's stream (link + selective prefill + decode, tokens picked by the
request's `mpic.engine.sampling.Sampler`) on a decode thread that hands each token straight to
the caller's event loop and does not wait for the consumer; the runner is not thread-safe, so
the thread holds the lock while it prefills and decodes, and every other call into the runner
holds it too (`held`). A consumer that goes away (closes the generator: a stop string, a client
gone) stops the thread at once: a request still waiting for the runner never prefills, a
running one stops after its current step.

Its model runs in this process, so it also offers the protocol's optional timing hooks
(`mpic.engine.protocol.Engine`: `num_layers`, `device`, `prefill_fn`, `floor_s`), which the
offline benchmark reads, and the fidelity benchmark's (`layer_adapter`: VLCache's calibration;
`variant`: the noise floors); its `Prefill` carries the scouting pass's cost (`Prefill.scout`).
"""

from __future__ import annotations

import asyncio
import copy
import statistics
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from mpic.engine.first_token import FirstToken
from mpic.engine.hf.compress import dense_nbytes
from mpic.engine.hf.reference_runner import Prefilled, ReferenceRunner
from mpic.engine.protocol import Decoded, GenerateRequest
from mpic.engine.request_flow import EngineBase, continued, prefill_of
from mpic.engine.sampling import Sampler
from mpic.engine.token_bytes import TokenBytes
from mpic.linker.chat_template import ChatTemplateOptions
from mpic.linker.prompt import tokenizer_of
from mpic.linker.recipe import PlannedPrompt
from mpic.presses.cache import CompressedKV
from mpic.prompt_parts import PromptPart
from mpic.types import CacheEntry


def kv_nbytes(kv: Any) -> int:
    """Bytes of a request's KV storage, room for the decoded tokens included: a
    `CompressedKV`'s (`nbytes`) or a dense linked KV's (`dense_nbytes`)."""
    return kv.nbytes() if isinstance(kv, CompressedKV) else dense_nbytes(kv)


class ReferenceEngine(EngineBase):
    """`Engine` over one `ReferenceRunner` (module docstring)."""

    def __init__(self, runner: ReferenceRunner) -> None:
        self.runner = runner
        self.spec = runner.spec
        self._lock = threading.Lock()
        self.token_bytes = TokenBytes(tokenizer_of(runner.processor))
        """The raw bytes of tokens (logprobs' `bytes`)."""

    @classmethod
    def load(cls, model_dir: str, **options: Any) -> ReferenceEngine:
        """The engine over a new `ReferenceRunner(model_dir, **options)` (the runner's
        arguments: device, dtype, system prompt, attention backend, decode correction, prefix
        linking, compilation)."""
        return cls(ReferenceRunner(model_dir, **options))

    @property
    def processor(self) -> Any:
        """The runner's HF processor."""
        return self.runner.processor

    @contextmanager
    def held(self) -> Iterator[ReferenceRunner]:
        """The runner, held for the caller's thread alone."""
        with self._lock:
            yield self.runner

    def cache_image(self, media: bytes, system_prompt: str | None = None) -> CacheEntry:
        """`ReferenceRunner.cache_image` under the lock."""
        with self.held() as runner:
            return runner.cache_image(media, system_prompt)

    def cache_document(self, text: str, system_prompt: str | None = None) -> CacheEntry:
        """`ReferenceRunner.cache_document` under the lock."""
        with self.held() as runner:
            return runner.cache_document(text, system_prompt)

    def press_entry(self, entry: CacheEntry, press: str, budget: float) -> CacheEntry:
        """`ReferenceRunner.press_entry` under the lock."""
        with self.held() as runner:
            return runner.press_entry(entry, press, budget)

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
        """`ReferenceRunner.plan` under the lock."""
        with self.held() as runner:
            return runner.plan(
                parts,
                policy,
                max_new_tokens,
                system_prompt,
                entries=entries,
                raw=raw,
                template=template,
            )

    async def decode(self, request: GenerateRequest) -> AsyncIterator[Decoded]:
        """`Engine.decode` on a decode thread (module docstring): one step per token (the
        request's `forced_ids` first), the first carrying the prefill (the KV bytes held,
        `kv_nbytes`; its first-token logits when `capture_first_token`; each token's logits [V]
        in `captured` when `capture_steps`)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        gone = threading.Event()

        def put(item: object) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:  # the loop is gone: nobody listens any more
                gone.set()

        thread = threading.Thread(
            target=self._decode, args=(request, gone, put), name="mpic-decode", daemon=True
        )
        thread.start()
        first = True
        try:
            while (item := await events.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                token, pre, logprobs, step = item
                prefill = None
                if first:
                    captured = (
                        FirstToken.from_logits(pre.logits) if request.capture_first_token else None
                    )
                    prefill = prefill_of(
                        pre.plan, pre.ttft_s, first_token=captured, recomputed=pre.recomputed_tokens
                    )
                    prefill.kv_bytes = kv_nbytes(pre.kv)
                    prefill.scout = pre.scout
                    first = False
                yield Decoded([token], logprobs, prefill, None if step is None else [step])
        finally:
            gone.set()

    @property
    def num_layers(self) -> int:
        """Decoder layers of the language model (optional `Engine` member)."""
        return self.runner.adapter.num_layers

    @property
    def device(self) -> str:
        """Device type the model runs on, "cpu" or "cuda" (optional `Engine` member)."""
        return self.runner.model.device.type

    @property
    def layer_adapter(self) -> Any:
        """The model's layer step (`mpic.engine.hf.adapters.HFLayerAdapter`), what VLCache's
        calibration prefills its proxy prompts through (optional `Engine` member; not under the
        lock: for a caller with no request in flight)."""
        return self.runner.adapter

    def variant(
        self, model_dir: str, dtype: str | None = None, attention: str | None = None
    ) -> ReferenceEngine:
        """This engine computing another way (optional `Engine` member: the fidelity
        benchmark's noise floors). `attention`, a backend of `mpic.kernels.attention`: a runner
        over the same model, entries and settings with that backend (the weights shared, its
        own lock: one caller at a time); `dtype` (a torch dtype name, "bfloat16"): a second copy
        of the model loaded from `model_dir` in that dtype, on the same device with the same
        settings. ValueError for neither or both, or for this engine's own dtype or backend
        (bit-identical)."""
        from mpic.kernels.attention import default_backend_name

        runner, adapter = self.runner, self.runner.adapter
        if (dtype is None) == (attention is None):
            raise ValueError("a variant takes a dtype or an attention backend")
        if dtype is not None:
            torch_dtype = getattr(torch, dtype, None)
            if not isinstance(torch_dtype, torch.dtype):
                raise ValueError(f"unknown dtype {dtype!r}")
            if adapter.dtype == torch_dtype:
                raise ValueError(f"the engine already runs in {torch_dtype}")
            return ReferenceEngine.load(
                model_dir,
                device=str(adapter.device),
                dtype=torch_dtype,
                system_prompt=runner.system_prompt,
                attention_backend=runner.attention_backend,
                decode_correction=runner.decode_correction,
                link_prefix=runner.prefixes is not None,
            )
        own = runner.attention_backend
        if own is None:
            own = default_backend_name(adapter.device)
        if own == attention:
            raise ValueError("the engine's own attention backend (bit-identical)")
        other = copy.copy(runner)  # the same model, entries and settings
        other.attention_backend = attention
        return ReferenceEngine(other)

    def prefill_fn(self, request: GenerateRequest) -> Callable[[], object]:
        """A zero-argument callable running `request`'s first-token prefill on the calling
        thread, as `decode` runs it but reserving no room to decode (optional `Engine` member:
        op counts, GPU profile)."""

        def prefill() -> object:
            with self.held() as runner:
                return runner.prefill(
                    request.parts,
                    request.policy,
                    0,
                    request.system_prompt,
                    request.press,
                    request.budget,
                    entries=request.entries,
                    raw=request.raw,
                    template=request.template,
                )

        return prefill

    @torch.inference_mode()
    def floor_s(self, num_tokens: int, repeats: int) -> float:
        """Median seconds of a plain HF forward of `num_tokens` text tokens through the language
        model (no cache, logits of the last token), after a warm-up: the floor of a selective
        pass that recomputes that many tokens (optional `Engine` member)."""
        with self.held() as runner:
            model = runner.model
            vocab = int(model.config.text_config.vocab_size)
            ids = torch.randint(
                0, vocab, (1, num_tokens), generator=torch.Generator().manual_seed(0)
            ).to(model.device)
            lm = model.model.language_model

            def once() -> float:
                start = time.perf_counter()
                hidden = lm(input_ids=ids, use_cache=False).last_hidden_state
                int(model.lm_head(hidden[:, -1]).argmax())  # waits for the device
                return time.perf_counter() - start

            once()
            return statistics.median(once() for _ in range(repeats))

    @contextmanager
    def _held_unless(self, stop: Callable[[], bool]) -> Iterator[bool]:
        """Hold the runner; yields False (without it) once `stop()` is true while waiting."""
        while not self._lock.acquire(timeout=0.02):
            if stop():
                yield False
                return
        try:
            yield True
        finally:
            self._lock.release()

    def _decode(
        self, request: GenerateRequest, gone: threading.Event, put: Callable[[object], None]
    ) -> None:
        """On the decode thread: the runner's stream under its lock at the runner's pace, each
        (token, prefill, logprobs, its `FirstToken` when `capture_steps` else None)
        `put` as decoded, an exception put as it is raised, then None. Stops at once when `gone`
        is set (before the prefill when still waiting)."""
        try:
            tokenizer = tokenizer_of(self.runner.processor)
            sampler = Sampler(
                request.sampling,
                lambda i: tokenizer.decode([i]),
                self.token_bytes,
                end_ids=[*self.spec.end_token_ids, *request.sampling.stop_token_ids],
            )
            earlier = list(request.continue_from)  # the prompt of vLLM's continuation

            def planned(pre: Prefilled) -> None:
                sampler.prompt_ids.update(pre.plan.token_ids.tolist() + earlier)

            picked: list[FirstToken | None] = [None]
            forced, step = list(request.forced_ids), [0]

            def pick(logits: torch.Tensor) -> int:
                if request.capture_steps:
                    picked[0] = FirstToken.from_logits(logits)
                step[0] += 1
                return sampler(logits, forced[step[0] - 1] if step[0] <= len(forced) else None)

            with self._held_unless(gone.is_set) as held:
                if not held or gone.is_set():  # abandoned while queued: no prefill at all
                    return
                for token, pre in self.runner.stream(
                    request.parts,
                    request.policy,
                    request.max_tokens,
                    system_prompt=request.system_prompt,
                    pick=pick,
                    press=request.press,
                    budget=request.budget,
                    stop_at_eos=not request.sampling.ignore_eos,
                    entries=request.entries,
                    raw=request.raw,
                    template=request.template,
                    continue_from=continued(request),
                    on_prefill=planned,
                ):
                    put((token, pre, sampler.take(), picked[0]))
                    if gone.is_set():
                        break
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            put(exc)
        finally:
            put(None)
