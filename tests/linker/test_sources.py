"""Rows grouped by source: every row is read from its own source at its own offset."""

from __future__ import annotations

import pytest
import torch

from mpic.linker.sources import group_by_source, take


def _rows(source: list[int], offsets: list[int]):
    return group_by_source(torch.tensor(source), torch.tensor(offsets))


def test_groups_by_source_keeping_order_within_one():
    grouped = _rows([-1, 0, 0, -1, 1, 1, 1, 0], [5, 3, 4, 6, 0, 1, 2, 9])
    assert [(g.source, g.size, g.first, g.contiguous) for g in grouped.groups] == [
        (-1, 2, 5, True),  # text rows are embedded by token id: their offsets go unread
        (0, 3, 3, False),  # 3, 4, 9: a jump
        (1, 3, 0, True),
    ]
    assert grouped.order.tolist() == [0, 3, 1, 2, 7, 4, 5, 6]
    assert grouped.offsets.tolist() == [5, 6, 3, 4, 9, 0, 1, 2]
    assert not grouped.in_input_order()


def test_an_entry_linked_twice_is_not_one_range():
    grouped = _rows([0, 0, 0, 0], [0, 1, 0, 1])
    assert [(g.source, g.contiguous) for g in grouped.groups] == [(0, False)]
    assert grouped.in_input_order()


def test_no_rows():
    assert _rows([], []).groups == []


@pytest.mark.parametrize("seed", range(5))
def test_take_reads_every_row_at_its_offset(seed):
    """Slices for ranges, gathers for the rest: equal to reading row by row."""
    gen = torch.Generator().manual_seed(seed)
    tables = [torch.randn(2, 30, 3, generator=gen) for _ in range(3)]
    n = 40
    source = torch.randint(0, 3, (n,), generator=gen)
    offsets = torch.randint(0, 30, (n,), generator=gen)
    offsets[:10] = torch.arange(10)  # one range, when its rows share a source
    source[:10] = 1
    grouped = group_by_source(source, offsets)
    got = torch.cat([take(tables[g.source], g, grouped.offsets, dim=1) for g in grouped.groups], 1)
    pairs = zip(source[grouped.order].tolist(), grouped.offsets.tolist(), strict=True)
    want = torch.stack([tables[s][:, o] for s, o in pairs], dim=1)
    assert torch.equal(got, want)
