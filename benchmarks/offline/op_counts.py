"""Where a prefill's time goes (CLI process, around calls that run their model in this process):
aten op counts with host<->device syncs and host-to-device copies (`count_ops`, any device), and
one profiled call's GPU busy time and kernel count (`profile_gpu`, CUDA only).

`mpic bench offline` runs one extra, untimed prefill per row under each (its op columns and
`--top-ops`). Counting needs no GPU, so the CPU can already compare how many ops each policy
dispatches; which of them would sync or copy on a GPU is only known where tensors live on one.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

SYNC_OPS = frozenset(
    {
        "aten._local_scalar_dense",  # item(), int(), float(), bool()
        "aten.item",  # composite ops reach the mode unexpanded under inference_mode
        "aten.nonzero",
        "aten.is_nonzero",
        "aten.equal",
        "aten.allclose",
        "aten.argwhere",
        "aten.nonzero_numpy",
        "aten.masked_select",
        "aten._unique",
        "aten._unique2",
        "aten.unique_dim",
        "aten.unique_consecutive",
        "aten.unique_dim_consecutive",
    }
)
"""Op packets whose CUDA kernels read device data back before they return (a device sync)."""

SYNC_OVERLOADS = frozenset(
    {
        "aten.where.default",  # torch.where(cond): nonzero
        "aten.repeat_interleave.Tensor",  # tensor repeats: the output size is read back
        "aten.repeat_interleave.self_Tensor",
    }
)
"""Overloads that sync where other overloads of the same op do not (repeat_interleave: unless
it is given its output size)."""

INDEX_OPS = frozenset({"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"})
"""Indexing ops: a boolean index is turned into positions (nonzero) inside the kernel."""

COPY_OPS = frozenset({"aten._to_copy", "aten.copy_", "aten.to"})
"""Copies (`aten.to` reaches the mode unexpanded under inference_mode)."""

Kind = Literal["sync", "h2d"]


def classify_op(
    name: str,
    inputs: Sequence[torch.device],
    output: torch.device | None,
    *,
    bool_index: bool = False,
    output_size: bool = False,
) -> Kind | None:
    """What an op costs beyond its kernel on a CUDA device: "sync" (it forces a device->host
    synchronisation), "h2d" (it copies host data to the device) or None; only device *types*
    matter, so any torch.device objects will do (no GPU needed).

    name: the overload, e.g. "aten.nonzero.default"; inputs: devices of its tensor inputs (a
    copy's destination included); output: its first tensor output's device (None: a scalar).
    bool_index: a boolean mask among an indexing op's indices; output_size: repeat_interleave
    was given its output size (then it does not read the repeats back)."""
    packet = name.rsplit(".", 1)[0]
    on_cuda = any(d.type == "cuda" for d in inputs)
    to_cuda = output is not None and output.type == "cuda"
    if packet in COPY_OPS:
        if on_cuda and output is not None and output.type == "cpu":
            return "sync"  # device -> host: the host waits for the data
        if to_cuda and any(d.type == "cpu" for d in inputs):
            return "h2d"
        return None
    if packet == "aten.lift_fresh" and to_cuda:
        return "h2d"  # torch.tensor(data, device="cuda"): built on the host, then copied
    if not on_cuda:
        return None
    if packet in SYNC_OPS or (packet in INDEX_OPS and bool_index):
        return "sync"
    if name in SYNC_OVERLOADS:
        return "sync" if not (output_size and packet == "aten.repeat_interleave") else None
    return None


@dataclass
class OpCounts:
    """The aten ops one call dispatched (`count_ops`)."""

    total: int = 0
    by_op: Counter[str] = field(default_factory=Counter)
    """Calls per op overload, e.g. "aten.mm.default"."""
    syncs: int | None = None
    """Ops that forced a device->host sync; None when no CUDA tensor was seen (unknowable)."""
    h2d_copies: int | None = None
    """Host-to-device copies; None when no CUDA tensor was seen."""
    sync_ops: Counter[str] = field(default_factory=Counter)
    """The syncing ops by overload (empty on a CPU-only run)."""


class _Counting(TorchDispatchMode):
    """Counts every aten op dispatched under it and classifies it with `classify_op`. A
    higher-order op (FlexAttention's eager call) counts as one op, "higher_order.<name>": its
    inner ops run unseen, as on CUDA, where it is one compiled kernel."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()
        self.kinds: dict[Kind, Counter[str]] = {"sync": Counter(), "h2d": Counter()}
        self.saw_cuda = False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let torch.compile'd code run compiled (the default mode would make dynamo fall back to
        eager): count what the compiled artefact dispatches, as the real call runs it."""
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        aten = isinstance(func, torch._ops.OpOverload)
        name = str(func) if aten else f"higher_order.{func.name()}"
        self.by_op[name] += 1
        inputs = [t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t.device for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.saw_cuda |= any(d.type == "cuda" for d in (*inputs, *outs))
        bool_index = (
            aten
            and str(func.overloadpacket) in INDEX_OPS
            and any(
                isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)
                for t in tree_leaves(args[1:2])
            )
        )
        sized = kwargs.get("output_size") is not None
        kind = classify_op(
            name, inputs, outs[0] if outs else None, bool_index=bool_index, output_size=sized
        )
        if kind is not None:
            self.kinds[kind][name] += 1
        return out


def count_ops(fn: Callable[[], Any]) -> OpCounts:
    """Run `fn()` once and count the aten ops it dispatches (compilation itself is not counted;
    a torch.compile'd call counts only the aten ops its compiled code dispatches, not its fused
    kernels; a higher-order op counts as one). syncs and h2d_copies are None unless a CUDA
    tensor was seen."""
    with _Counting() as mode:
        fn()
    cuda = mode.saw_cuda
    return OpCounts(
        total=sum(mode.by_op.values()),
        by_op=mode.by_op,
        syncs=sum(mode.kinds["sync"].values()) if cuda else None,
        h2d_copies=sum(mode.kinds["h2d"].values()) if cuda else None,
        sync_ops=mode.kinds["sync"],
    )


@dataclass
class GpuProfile:
    """One profiled call on a CUDA device (`profile_gpu`)."""

    busy_ms: float
    """Union of the call's kernel intervals on the device (overlaps counted once)."""
    kernels: int
    wall_ms: float
    """Wall time of the call until the device finished (profiler overhead included)."""
    table: str | None = None
    """The profiler's top ops by self device time, when asked for."""

    @property
    def busy_share(self) -> float:
        """busy_ms / wall_ms: how much of the wall time the GPU was running kernels."""
        return self.busy_ms / self.wall_ms if self.wall_ms > 0 else 0.0


def busy_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals: time covered by at least one of them."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def profile_gpu(fn: Callable[[], Any], top: int = 0) -> GpuProfile:
    """Run `fn()` once under torch.profiler (CPU and CUDA activities), synchronised before and
    after. Busy time is the union of kernel intervals, not their sum, so kernels overlapping on
    several streams are not counted twice; copies and memsets are left out (`count_ops` counts
    the copies). top > 0: also the profiler's top-`top` op table by self device time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = [
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    table = None
    if top > 0:
        table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=top)
    return GpuProfile(busy_us(kernels) / 1000, len(kernels), wall * 1000, table)
