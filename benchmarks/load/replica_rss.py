"""The memory of the local Serve replica processes over a load run (CLI process): the summed
RSS of the processes Ray names `ServeReplica:<app>:<Deployment>`, by deployment (`sample_rss`),
sampled each second on a thread into a `LoadResult` (`RssSampler`).
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter

from mpic.benchmarks.load.report import LoadResult

_REPLICA = re.compile(r"ServeReplica:[^:\s]+:(\w+)")


def sample_rss() -> dict[str, float]:
    """Summed RSS (MB) of the local Serve replica processes, by deployment."""
    import psutil

    out: Counter[str] = Counter()
    for proc in psutil.process_iter(["cmdline", "memory_info"]):
        try:
            title = " ".join(proc.info["cmdline"] or [])
            m = _REPLICA.search(title)
            if m and proc.info["memory_info"] is not None:
                out[m.group(1)] += proc.info["memory_info"].rss / 2**20
        except (psutil.Error, TypeError):
            continue
    return dict(out)


class RssSampler:
    """Samples `sample_rss` every `period_s` on a thread into `out.rss_mb`."""

    def __init__(self, out: LoadResult, t_start: float, period_s: float = 1.0) -> None:
        self.out, self.t_start, self.period = out, t_start, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter() - self.t_start
            for dep, mb in sample_rss().items():
                self.out.rss_mb.setdefault(dep, []).append((round(t, 2), round(mb, 1)))
            self._stop.wait(self.period)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
