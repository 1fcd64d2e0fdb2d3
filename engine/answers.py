"""How far an answer moved from the exact one (any process that compares two greedy answers:
`mpic bench fidelity`, the LLM worker's live fidelity monitor): token by token, the share of
the first L positions with equal tokens and the exact prefix (a sequence that stopped early is
padded with its end token, or a sentinel, so two answers that both ended agree from there on);
word by word, ROUGE-L F1 (Elastic Cache's metric).
"""

from __future__ import annotations

import re


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


def rouge_l_f1(candidate: str, reference: str) -> float:
    """ROUGE-L F1 (beta 1) of two texts over lower-cased word tokens: LCS / len gives recall and
    precision (Lin 2004). 1.0 for two empty texts, 0.0 if exactly one is empty."""
    cand, ref = _words(candidate), _words(reference)
    if not cand or not ref:
        return float(not cand and not ref)
    lcs = _lcs_length(cand, ref)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(cand), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _lcs_length(a: list[str], b: list[str]) -> int:
    """Longest common subsequence length (O(len(a) * len(b)) dynamic programme, one row)."""
    row = [0] * (len(b) + 1)
    for x in a:
        prev = 0
        for j, y in enumerate(b, start=1):
            cur = row[j]
            row[j] = prev + 1 if x == y else max(row[j], row[j - 1])
            prev = cur
    return row[-1]
