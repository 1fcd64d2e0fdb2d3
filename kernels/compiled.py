"""Compiled functions that hold (kernels; every process that runs a model: reference runner,
benchmarks): `torch.compile` with dynamic shapes and `fullgraph=True`, one compiled object per
(function, dynamo backend) for the process, and a fall to eager that is never silent.

Why fullgraph: past dynamo's recompile limit (`torch._dynamo.config.recompile_limit`, 8) a
compiled function silently runs eagerly for good; with fullgraph the call raises
`FailOnRecompileLimitHit` instead, and `CompiledFunction` answers it eagerly, counts it, logs
the first one with its reason, and `compile_stats` reports it (the LLM worker exports it as
`mpic_flex_eager_falls`; `mpic bench offline` as its `eager_falls` column). Callers keep the set
of graphs bounded themselves (functions defined once at module level, per-request tensors passed
as arguments, sizes padded where dynamo would specialise), so a fall means a bug.

A compile that fails outright (a lowering error) is either raised to the caller (`on_error=
"raise"`: FlexAttention retries other kernel options) or makes the function eager for the rest
of the process, with one warning (`on_error="eager"`: the compiled layer step).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

logger = logging.getLogger(__name__)


@dataclass
class _Stats:
    """One compiled function's record in this process."""

    eager_falls: int = 0
    """Calls answered eagerly after a recompile-limit hit."""
    last_fall: str = ""
    """The last fall's reason (dynamo's message)."""
    failed: str = ""
    """Why compiling failed for good ("" while it works; `on_error="eager"` only)."""


_COMPILED: dict[tuple[Callable[..., Any], str], CompiledFunction] = {}


class CompiledFunction:
    """`fn` compiled by dynamo `backend` (dynamic shapes, fullgraph), called like `fn`; past
    the recompile limit, `eager(*args, **kwargs)` (default `fn`) answers, counted and logged.
    Build it with `compiled(fn, backend)` (one per process and backend)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        backend: str = "inductor",
        eager: Callable[..., Any] | None = None,
        on_error: Literal["raise", "eager"] = "raise",
    ) -> None:
        self.fn = fn
        self.backend = backend
        self.eager = eager or fn
        self.on_error = on_error
        self.stats = _Stats()
        self._compiled = torch.compile(fn, dynamic=True, fullgraph=True, backend=backend)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch._dynamo.exc import FailOnRecompileLimitHit

        if self.stats.failed:
            return self.eager(*args, **kwargs)
        try:
            return self._compiled(*args, **kwargs)
        except FailOnRecompileLimitHit as exc:
            self._fall(exc)
            return self.eager(*args, **kwargs)
        except Exception as exc:  # inductor lowering errors have no stable public type
            if self.on_error == "raise":
                raise
            self.stats.failed = _reason(exc)
            warnings.warn(
                f"compiling {self.fn.__name__} failed ({self.stats.failed}); it runs eagerly "
                "in this process",
                stacklevel=2,
            )
            return self.eager(*args, **kwargs)

    def _fall(self, exc: Exception) -> None:
        """Count and (the first time) log one call answered eagerly past the limit."""
        reason = _reason(exc.__cause__ or exc)
        if self.stats.eager_falls == 0:
            logger.warning(
                "compiled %s hit dynamo's recompile limit (%s graphs); it runs eagerly from now "
                "on (TORCH_LOGS=recompiles shows each recompile's failing guard). Reason: %s",
                self.fn.__name__,
                graph_count(self.fn),
                reason,
            )
        self.stats.eager_falls += 1
        self.stats.last_fall = reason


def compiled(
    fn: Callable[..., Any],
    backend: str = "inductor",
    eager: Callable[..., Any] | None = None,
    on_error: Literal["raise", "eager"] = "raise",
) -> CompiledFunction:
    """The process's `CompiledFunction` of `fn` under dynamo `backend` (built on first use)."""
    key = (fn, backend)
    if key not in _COMPILED:
        _COMPILED[key] = CompiledFunction(fn, backend, eager, on_error)
    return _COMPILED[key]


def graph_count(fn: Callable[..., Any]) -> int | None:
    """Graphs dynamo keeps for `fn`'s code object, every backend together (each recompile adds
    one); None where this torch does not say."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        return len(_debug_get_cache_entry_list(fn.__code__))
    except Exception:  # a private helper: absent or changed in another torch
        return None


def compile_stats() -> dict[str, Any]:
    """This process's compiled functions: `graphs` (summed over functions; None where torch does
    not say), `eager_falls` (calls answered eagerly past the recompile limit), `last_fall` (its
    reason), `failed` (functions whose compile failed for good, with why), and `by_function`
    (the same per function name)."""
    by_function: dict[str, dict[str, Any]] = {}
    for (fn, _backend), c in _COMPILED.items():
        row = by_function.setdefault(
            fn.__name__, {"graphs": graph_count(fn), "eager_falls": 0, "last_fall": ""}
        )
        row["eager_falls"] += c.stats.eager_falls
        row["last_fall"] = c.stats.last_fall or row["last_fall"]
        if c.stats.failed:
            row["failed"] = c.stats.failed
    counts = [r["graphs"] for r in by_function.values()]
    return {
        "graphs": None if None in counts else sum(counts),
        "eager_falls": sum(r["eager_falls"] for r in by_function.values()),
        "last_fall": next((r["last_fall"] for r in by_function.values() if r["last_fall"]), ""),
        "failed": {n: r["failed"] for n, r in by_function.items() if "failed" in r},
        "by_function": by_function,
    }


def _reason(exc: BaseException) -> str:
    """An exception as one line of at most 300 characters."""
    return " ".join(str(exc).split())[:300] or type(exc).__name__
