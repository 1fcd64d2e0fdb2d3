"""Pacing of the background linking thread (vLLM worker process): a share of the CPU while
vLLM's forwards run.

The worker half links requests on its own thread (`mpic.engine.vllm.connector.worker`), on the
cores vLLM's forward does not use. Where those cores are not independent (2 vCPUs sharing one
physical core, a busy host) or the GIL is contended, linking at full speed slows the decoding
requests' forwards: measured on the 2-vCPU development hosts, a compute thread on the other
vCPU halves the forward's core's speed. `LinkPacer` lets the linking thread run at most
`share` of the wall time while a forward ran in the last `idle_s` seconds: after each layer
call (`mpic.engine.vllm.connector.model_lock.YieldingAdapter`, with the model free) it sleeps
`worked * (1 / share - 1)`; with no forward (nothing decoding) it runs at full speed. share 1.0
(default) never sleeps. The cost is the linked requests' time to first token (their link takes
up to 1 / share times longer while others decode).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class LinkPacer:
    """Sleeps the linking thread to `share` of the wall time while `busy()` (see module)."""

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
