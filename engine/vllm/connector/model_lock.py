"""One model at a time: vLLM's step and the background linking thread (vLLM worker process).

vLLM's CPU kernels are not safe to run from two threads at once. A `onednn_mm` linear sets the
input and output pointers and the row count of its layer's primitive handler before it
executes, so two threads in one layer swap each other's buffers; every oneDNN matmul and
`cpu_attention_with_kv_cache` use one process-wide scratchpad (`cpu_utils::ScratchPadManager`)
that a larger call frees and reallocates. The linking thread (load mode `background`,
`mpic.engine.vllm.connector.worker`) runs vLLM's layers and attention ops while vLLM's forward
runs them: it gave nondeterministic wrong tokens in the exactness tests and once killed the
engine core (a scratchpad freed under a running kernel).

`ModelLock` makes the two take turns, with vLLM's step first: the model runner's
`execute_model` and `sample_tokens` hold it for the whole step (`guard_runner`; the encoder,
the forward, the logits and the sampler); the linking thread holds it while it links and gives
it up at every layer (`YieldingAdapter`: before each layer call it lets a waiting step run
first). A step thus waits for at most one layer of one link batch, and linking goes on between
steps and while nothing decodes. Pacing naps (`LinkPacer`) are taken without the lock.

Pacing (`LinkPacer`): the linking thread's share of the CPU while vLLM's forwards run. The
worker half links requests on its own thread, on the cores vLLM's forward does not use. Where
those cores are not independent (2 vCPUs sharing one physical core, a busy host) or the GIL is
contended, linking at full speed slows the decoding requests' forwards: measured on the 2-vCPU
development hosts, a compute thread on the other vCPU halves the forward's core's speed.
`LinkPacer` lets the linking thread run at most `share` of the wall time while a forward ran in
the last `idle_s` seconds: after each layer call (`YieldingAdapter`, with the model free) it
sleeps `worked * (1 / share - 1)`; with no forward (nothing decoding) it runs at full speed.
share 1.0 (default) never sleeps. The cost is the linked requests' time to first token (their
link takes up to 1 / share times longer while others decode).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any

import torch


class ModelLock:
    """Turns between vLLM's step (`step`, first whenever it waits) and the linking thread
    (`linking`, `yield_turn`)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._owner: str | None = None
        self._steps_waiting = 0
        self.steps_waited = 0
        """Steps that found the linking thread holding the model (a counter)."""

    @contextmanager
    def step(self) -> Iterator[None]:
        """vLLM's step: waits for the linking thread's current layer, never for its batch."""
        with self._cond:
            if self._owner == "step":  # re-entered (a step calling into another): already ours
                reentered = True
            else:
                reentered = False
                self._steps_waiting += 1
                if self._owner is not None:
                    self.steps_waited += 1
                while self._owner is not None:
                    self._cond.wait()
                self._steps_waiting -= 1
                self._owner = "step"
        try:
            yield
        finally:
            if not reentered:
                with self._cond:
                    self._owner = None
                    self._cond.notify_all()

    def _acquire_linking(self) -> None:
        with self._cond:
            while self._owner is not None or self._steps_waiting:
                self._cond.wait()
            self._owner = "linking"

    def _release_linking(self) -> None:
        with self._cond:
            if self._owner == "linking":
                self._owner = None
                self._cond.notify_all()

    @contextmanager
    def linking(self) -> Iterator[None]:
        """The linking thread's turn for a batch (given up at each `yield_turn`)."""
        self._acquire_linking()
        try:
            yield
        finally:
            self._release_linking()

    def yield_turn(self) -> None:
        """Inside `linking`: let a waiting step run first, then take the model back."""
        with self._cond:
            if not self._steps_waiting:
                return
        self._release_linking()
        self._acquire_linking()

    @contextmanager
    def released(self) -> Iterator[None]:
        """Inside `linking`: the model is free for the block (a pacing nap)."""
        self._release_linking()
        try:
            yield
        finally:
            self._acquire_linking()


def guard_runner(runner: Any, lock: ModelLock) -> None:
    """Make `runner`'s `execute_model` and `sample_tokens` (those it has) hold `lock`'s step
    turn (instance attributes over the class's methods; once per runner)."""
    if getattr(runner, "_mpic_model_lock", None) is lock:
        return
    for name in ("execute_model", "sample_tokens"):
        method: Callable | None = getattr(runner, name, None)
        if method is None:
            continue

        def guarded(*args: Any, _method: Callable = method, **kwargs: Any) -> Any:
            with lock.step():
                return _method(*args, **kwargs)

        setattr(runner, name, wraps(method)(guarded))
    runner._mpic_model_lock = lock


class YieldingAdapter:
    """A `LayerAdapter` for the linking thread: before each layer call it yields the model to a
    waiting step (`ModelLock.yield_turn`); after it, a pacing nap (`pacer`, when given) is taken
    with the model free. Other attributes are the wrapped adapter's."""

    def __init__(self, adapter: Any, lock: ModelLock, pacer: LinkPacer | None = None) -> None:
        self._adapter = adapter
        self._lock = lock
        self._pacer = pacer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._adapter, name)

    def _after(self) -> None:
        if self._pacer is not None:
            with self._lock.released():
                self._pacer.pause()

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        self._lock.yield_turn()
        return self._adapter.embed_tokens(token_ids)

    def attention_inputs(
        self, layer: int, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self._lock.yield_turn()
        out = self._adapter.attention_inputs(layer, hidden, positions)
        self._after()
        return out

    def attention_output_and_mlp(
        self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor
    ) -> torch.Tensor:
        self._lock.yield_turn()
        out = self._adapter.attention_output_and_mlp(layer, hidden, attn_out)
        self._after()
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self._lock.yield_turn()
        return self._adapter.logits(hidden)


class LinkPacer:
    """Sleeps the linking thread to `share` of the wall time while `busy()` (module docstring,
    "Pacing")."""

    def __init__(self, share: float, busy: Callable[[], bool]) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"link_share must be in (0, 1], not {share}")
        self.share = share
        self._busy = busy
        self._since = time.perf_counter()
        self.slept_s = 0.0

    def start(self) -> None:
        """A batch begins: work is counted from now."""
        self._since = time.perf_counter()

    def pause(self) -> None:
        """After a unit of work: yield the CPU for the share's complement of it."""
        now = time.perf_counter()
        if self.share < 1 and self._busy():
            nap = (now - self._since) * (1 / self.share - 1)
            time.sleep(nap)
            self.slept_s += nap
        self._since = time.perf_counter()
