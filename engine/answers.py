"""How far an answer moved from the exact one, token by token (any process that compares two
greedy answers: `mpic bench fidelity`, the LLM worker's live fidelity monitor): the share of
the first L positions with equal tokens and the exact prefix. A sequence that stopped early is
padded with its end token (or a sentinel), so two answers that both ended agree from there on.
"""

from __future__ import annotations


def token_agreement(tokens: list[int], ref: list[int], length: int, eos: int | None) -> float:
    """Share of the first `length` positions with equal tokens (a sequence that stopped is padded
    with `eos`, or a sentinel no token equals when None)."""
    a, b = _padded(tokens, length, eos), _padded(ref, length, eos)
    return sum(x == y for x, y in zip(a, b, strict=True)) / length


def exact_prefix(tokens: list[int], ref: list[int], length: int, eos: int | None) -> int:
    """How many leading tokens (of at most `length`) equal the reference's."""
    count = 0
    for x, y in zip(_padded(tokens, length, eos), _padded(ref, length, eos), strict=True):
        if x != y:
            break
        count += 1
    return count


def _padded(tokens: list[int], length: int, eos: int | None) -> list[int]:
    pad = -1 if eos is None else eos
    return (list(tokens) + [pad] * length)[:length]
