"""Prompt rows grouped by the tensor they are read from (linker): the prompt's text, or one cache
entry (`LinkPlan.source_entry`, -1 for text), so that linking reads each entry ONCE, whatever
the number of its rows or their order.

`group_by_source` sorts the rows by source (stable: rows keep their order within a source) with
a few host ops over the plan's host tensors, whatever the number of entries; `take` then reads
one group from its table as a slice where its offsets are one ascending range (mpic-k, full
reuse: no copy, no index) and else as one gather (a scout's scattered picks). Reading an entry
per run of consecutive offsets instead costs ops per run (hundreds for scattered picks), and
per entry with a mask costs a nonzero and a comparison per entry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SourceGroup:
    """The rows of one source, rows [start, end) of the grouped order."""

    source: int
    """Entry index into the plan's entries; -1: text."""
    start: int
    end: int
    first: int
    """The first row's offset in its source."""
    contiguous: bool
    """Offsets first, first + 1, ..., first + end - start - 1: the group is one slice."""

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Grouped:
    """Rows grouped by source (`group_by_source`)."""

    order: torch.Tensor
    """Host int64 [n]: the rows' positions in their input, sorted by source (stable)."""
    offsets: torch.Tensor
    """Host int64 [n]: the rows' offsets in their source, in grouped order."""
    groups: list[SourceGroup]
    """One per source present, by ascending source (text first)."""

    def in_input_order(self) -> bool:
        """Whether no row moved (the input was already grouped)."""
        return bool(torch.equal(self.order, torch.arange(self.order.numel())))


def group_by_source(source: torch.Tensor, offsets: torch.Tensor) -> Grouped:
    """`Grouped` of rows with host int64 `source` [n] (-1: text) and `offsets` [n]."""
    order = torch.argsort(source, stable=True)
    src, off = source[order], offsets[order]
    n = int(order.numel())
    if n == 0:
        return Grouped(order, off, [])
    # per boundary between rows i and i+1: 2 = a new source starts, 1 = the offsets jump
    code = (src[1:] != src[:-1]).to(torch.int8) * 2 + (off[1:] != off[:-1] + 1).to(torch.int8)
    at = torch.nonzero(code).flatten()
    marks = zip((at + 1).tolist(), code[at].tolist(), strict=True)
    starts, jumps = [0], set()
    for row, kind in marks:
        if kind >= 2:
            starts.append(row)
        else:
            jumps.add(len(starts) - 1)  # a jump inside the current group
    heads = torch.stack([src, off])[:, starts].tolist()
    ends = [*starts[1:], n]
    groups = [
        SourceGroup(s, a, b, o, i not in jumps)
        for i, (a, b, s, o) in enumerate(zip(starts, ends, heads[0], heads[1], strict=True))
    ]
    return Grouped(order, off, groups)


def take(
    table: torch.Tensor, group: SourceGroup, offsets: torch.Tensor | None, dim: int = 0
) -> torch.Tensor:
    """The group's rows of `table` along `dim`: a slice where the group is contiguous, else a
    gather by `offsets` (the grouped offsets on table's device: `Grouped.offsets`, moved once
    for every group)."""
    if group.contiguous:
        return table.narrow(dim, group.first, group.size)
    assert offsets is not None, "a scattered group needs the grouped offsets"
    rows = offsets[group.start : group.end]
    return table.index_select(dim, rows if rows.device == table.device else rows.to(table.device))
