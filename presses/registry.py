"""Press registry: names -> press objects (any process that compresses KV)."""

from __future__ import annotations

from collections.abc import Callable

from mpic.presses import PRESS_NAMES
from mpic.presses.base import BasePress
from mpic.presses.elastic_cache import ElasticCachePress
from mpic.presses.meda import MEDAPress
from mpic.presses.mm_shiftkv import MMShiftKVPress
from mpic.presses.snapkv import SnapKVPress
from mpic.presses.window import WindowPress

PRESSES: dict[str, Callable[[], BasePress]] = {
    "elastic": ElasticCachePress,
    "mm-shiftkv": MMShiftKVPress,
    "meda": MEDAPress,
    "window": WindowPress,
    "snapkv": SnapKVPress,
}
"""The seed papers' presses, then the two baselines."""
assert tuple(PRESSES) == PRESS_NAMES


def get_press(name: str) -> BasePress:
    """A fresh press by name; ValueError naming the known ones otherwise."""
    try:
        return PRESSES[name]()
    except KeyError:
        raise ValueError(f"unknown press {name!r}; known: {', '.join(PRESSES)}") from None


def check_budget(budget: float) -> float:
    """A budget in (0, 1] (fraction of the prompt's KV kept), else ValueError."""
    if not 0.0 < float(budget) <= 1.0:
        raise ValueError(f"budget must be in (0, 1], got {budget}")
    return float(budget)
