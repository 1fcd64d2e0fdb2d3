"""vLLM's sampling extensions in the reference and fake engines' `Sampler` and the request flow's
`TextStream` (`engine/sampling.py`, `engine/request_flow.py`): penalties equal vLLM's own
`apply_penalties` on the same logits, `min_tokens` holds the end ids and the stop strings back,
`top_k` / `min_p` restrict the draw. Both engines' greedy answers under them:
`tests/deployments/engines/test_eos_parity.py`, `test_default_parity.py`."""

from __future__ import annotations

import pytest
import torch

from mpic.engine.protocol import Sampling
from mpic.engine.request_flow import TextStream
from mpic.engine.sampling import Sampler, stop_ids

VOCAB = 12


def _logits(seed: int) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_penalties_equal_vllms_own() -> None:
    utils = pytest.importorskip("vllm.model_executor.layers.utils")
    prompt, answer = [0, 3, 3, 7], [3, 5, 5]
    s = Sampling(repetition_penalty=1.7, frequency_penalty=0.4, presence_penalty=0.3)
    sampler = Sampler(s, prompt_ids=prompt)
    for token in answer:  # teacher-forced: the answer so far
        sampler(_logits(0), forced=token)
    got = sampler.processed(_logits(1))
    want = utils.apply_penalties(
        _logits(1)[None].clone(),
        torch.tensor([prompt]),
        torch.tensor([answer]),
        torch.tensor([s.presence_penalty]),
        torch.tensor([s.frequency_penalty]),
        torch.tensor([s.repetition_penalty]),
    )[0]
    torch.testing.assert_close(got, want)
    assert not torch.equal(got, _logits(1))


def test_repetition_penalty_changes_the_greedy_pick() -> None:
    logits = torch.zeros(VOCAB)
    logits[4], logits[9] = 2.0, 1.5  # 4 wins unless penalised (it is in the prompt)
    assert Sampler(Sampling(), prompt_ids=[4])(logits) == 4
    assert Sampler(Sampling(repetition_penalty=1.5), prompt_ids=[4])(logits) == 9


def test_min_tokens_holds_the_end_ids_back() -> None:
    logits = torch.zeros(VOCAB)
    logits[2] = 5.0  # an end id, the greedy pick
    sampler = Sampler(Sampling(min_tokens=3), end_ids=[2])
    assert [sampler(logits) for _ in range(4)] != [2, 2, 2, 2]
    sampler = Sampler(Sampling(min_tokens=3), end_ids=[2])
    picks = [sampler(logits) for _ in range(4)]
    assert 2 not in picks[:3] and picks[3] == 2


@pytest.mark.parametrize(
    ("field", "value"), [("top_k", 1), ("min_p", 1.0), ("top_k", 2), ("min_p", 0.5)]
)
def test_top_k_and_min_p_restrict_the_draw(field: str, value: float) -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0, 2.0, 0.5])
    probs = torch.softmax(logits, -1)
    allowed = {
        ("top_k", 1): {1},
        ("min_p", 1.0): {1},
        ("top_k", 2): {1, 2},
        ("min_p", 0.5): {i for i in range(6) if probs[i] >= 0.5 * probs.max()},
    }[(field, value)]
    sampler = Sampler(Sampling(temperature=1.0, seed=3, **{field: value}))
    picks = {sampler(logits) for _ in range(200)}
    assert picks == allowed  # every allowed token drawn, no other
    everything = Sampler(Sampling(temperature=1.0, seed=3))
    assert {everything(logits) for _ in range(200)} > allowed


class _Chars:
    """A tokenizer whose token i is the character chr(97 + i)."""

    def decode(self, ids, **_: object) -> str:
        return "".join(chr(97 + i) for i in ids)


def test_stop_strings_are_looked_for_after_min_tokens() -> None:
    tokens = [2, 1, 0, 3, 2, 1, 4]  # "cbadcbe"
    plain = TextStream(_Chars(), ["cb"])
    assert plain.push(tokens).text == "" and plain.stopped  # "cb" at the start
    held = TextStream(_Chars(), ["cb"], min_tokens=2)
    text = held.push(tokens[:1]).text + held.push(tokens[1:]).text
    assert text == "cbad" and held.stopped  # the first "cb" is in the first 2 tokens' text


@pytest.mark.parametrize(("include", "want"), [(False, "cb"), (True, "cba")])
def test_a_stop_token_ends_the_text(include: bool, want: str) -> None:
    stream = TextStream(_Chars(), [], stop_ids=[0], include_stop=include)  # "a" stops
    text = stream.push([2, 1]).text + stream.push([0, 3, 2]).text  # "cb", then "a" and more
    assert text == want and stream.stopped and stream.flush() is None
    assert stream.tokens == [2, 1, 0]  # the stop token counted, what follows it dropped


def test_a_stop_string_is_kept_when_asked() -> None:
    stream = TextStream(_Chars(), ["ad"], include_stop=True)
    assert stream.push([2, 1, 0, 3, 2]).text == "cbad" and stream.stopped


def test_a_stop_token_after_held_text_releases_it() -> None:
    # "cb" may begin the stop string "cbx": held back, then the stop token ends the answer
    stream = TextStream(_Chars(), ["cbx"], stop_ids=[0])
    assert stream.push([2, 1]).text == ""
    assert stream.push([0]).text == "cb" and stream.stopped


def test_stop_ids_follow_vllms_rule() -> None:
    assert stop_ids([7, 2], [2, 0], ignore_eos=False) == [7, 2, 0]  # each id once, own first
    assert stop_ids([7], [2, 0], ignore_eos=True) == [7]  # own stop ids stop with ignore_eos too
    assert stop_ids([], [2], ignore_eos=False) == [2]
