"""Both engines stop at the model's end token over HTTP (issue 22 item 1): the tiny Qwen2-VL
emits `<|im_end|>` within a few tokens; the reference engine and the vLLM worker (in-process
apps, no Ray, the same model folder and store; text-only chats) answer the same chat with the
same text, the same completion token count (the end token included) and `finish_reason:
"stop"`, well before `max_tokens`. `ignore_eos: true` decodes to `max_tokens` on both. vLLM's
`min_tokens` (the end token held back) and `repetition_penalty` (prompt and answer tokens
penalised) give the same greedy answers on both, different from the answers without them.
`skip_special_tokens: false` says the same special tokens on both: `<|im_end|>` past the end
with `ignore_eos`, and the ending one only with `include_stop_str_in_output` (vLLM's rule)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deployments.conftest import ADMIN_KEY, KEYS
from tests.deployments.inprocess import InProcessApp, fake_config, in_process_app

pytestmark = pytest.mark.slow

MAX_TOKENS = 48
ALICE = {"Authorization": "Bearer alice-key"}


MIN_TOKENS = 16

PROMPTS = ["dog blue", "red two", "blue sun"]
"""Prompts on which the seeded tiny Qwen2-VL says <|im_end|> after 10, 20 and 42 tokens."""


@pytest.fixture(scope="module")
def answers(tiny_qwen2vl_dir: Path, tmp_path_factory) -> dict[str, dict[str, dict]]:
    """engine -> prompt (and "ignore_eos") -> the chat's JSON. The apps are opened one after the
    other: in-process apps share one FastAPI app, and one opened inside another takes its
    routes over (both clients would reach the inner app's engine)."""
    store = tmp_path_factory.mktemp("eos-store")
    out: dict[str, dict[str, dict]] = {}
    stop_id = None
    for kind, extra in (("reference", {}), ("vllm", {"max_model_len": 1024})):
        cfg = fake_config(store, kind=kind, model=str(tiny_qwen2vl_dir), **extra)
        with in_process_app(cfg, KEYS, [ADMIN_KEY]) as app:
            assert app.worker.engine.__class__.__module__.endswith(f"{kind}_engine") or (
                kind == "vllm" and "vllm" in app.worker.engine.__class__.__module__
            )
            got = {text: _chat(app, text) for text in PROMPTS}
            got["ignore_eos"] = _chat(app, "Describe it.", ignore_eos=True)
            got["min_tokens"] = _chat(app, PROMPTS[0], min_tokens=MIN_TOKENS)
            got["repetition"] = _chat(app, PROMPTS[1], repetition_penalty=5.0)
            said = {"skip_special_tokens": False}
            got["specials"] = _chat(app, PROMPTS[0], ignore_eos=True, **said)
            got["end_said"] = _chat(app, PROMPTS[0], include_stop_str_in_output=True, **said)
            got["end_unsaid"] = _chat(app, PROMPTS[0], **said)
            stop_id = stop_id or _middle_token(app.worker.engine.runner)
            got["stop_id"] = _chat(app, PROMPTS[2], stop_token_ids=[stop_id])
            # min_tokens holds the request's stop ids back too (vLLM's rule), past their place
            got["stop_id_held"] = _chat(app, PROMPTS[2], stop_token_ids=[stop_id], min_tokens=32)
            bad = {**_body(PROMPTS[0]), "stop_token_ids": [10**9]}
            got["bad_stop_id"] = app.client.post(
                "/v1/chat/completions", json=bad, headers=ALICE, timeout=600
            ).json()
            out[kind] = got
    return out


def _middle_token(runner) -> int:
    """A token in the middle of the reference engine's greedy answer to PROMPTS[2] (offline:
    the same tokens as over HTTP), the first of its kind there: the stop token."""
    tokens = runner.generate([PROMPTS[2]], "full", max_new_tokens=MAX_TOKENS).tokens
    token = tokens[len(tokens) // 2]
    assert tokens.index(token) > 0 and token not in runner.spec.end_token_ids
    return token


def _chat(app: InProcessApp, text: str, ignore_eos: bool = False, **sampling: object) -> dict:
    """A text-only chat (both engines compute it whole: no entry made by either vision tower,
    which differ on Qwen2-VL); `sampling`: more request fields."""
    resp = app.client.post(
        "/v1/chat/completions",
        json=_body(text, ignore_eos, **sampling),
        headers=ALICE,
        timeout=600,
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def _body(text: str, ignore_eos: bool = False, **sampling: object) -> dict:
    return {
        **sampling,
        "model": "mpic",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": ignore_eos,
        "mpic": {"policy": "full"},
        "messages": [{"role": "user", "content": text}],
    }


def _answer(out: dict) -> tuple[str, int, str]:
    choice = out["choices"][0]
    return choice["message"]["content"], out["usage"]["completion_tokens"], choice["finish_reason"]


def test_both_engines_stop_at_the_end_token(answers: dict[str, dict[str, dict]]) -> None:
    for text in PROMPTS:
        ref = _answer(answers["reference"][text])
        got = _answer(answers["vllm"][text])
        assert got == ref, text
        assert ref[2] == "stop" and ref[1] < MAX_TOKENS, (text, ref)


def test_ignore_eos_runs_to_max_tokens_on_both(answers: dict[str, dict[str, dict]]) -> None:
    for name in ("reference", "vllm"):
        _, tokens, finish = _answer(answers[name]["ignore_eos"])
        assert (tokens, finish) == (MAX_TOKENS, "length"), name


def test_min_tokens_and_repetition_penalty_the_same_on_both(answers) -> None:
    held = {name: _answer(answers[name]["min_tokens"]) for name in ("reference", "vllm")}
    assert held["vllm"] == held["reference"]
    plain = _answer(answers["reference"][PROMPTS[0]])
    assert plain[1] < MIN_TOKENS <= held["reference"][1]  # the end token came later
    assert held["reference"][0].startswith(plain[0])  # the same greedy path up to there
    penalised = {name: _answer(answers[name]["repetition"]) for name in ("reference", "vllm")}
    assert penalised["vllm"] == penalised["reference"]
    assert penalised["reference"][0] != _answer(answers["reference"][PROMPTS[1]])[0]


def test_a_stop_token_ends_the_answer_alike_on_both(answers) -> None:
    cut = {name: _answer(answers[name]["stop_id"]) for name in ("reference", "vllm")}
    assert cut["vllm"] == cut["reference"]
    plain = _answer(answers["reference"][PROMPTS[2]])
    assert cut["reference"][2] == "stop" and cut["reference"][1] < plain[1]
    assert plain[0].startswith(cut["reference"][0])  # the plain answer, cut before that token
    held = {name: _answer(answers[name]["stop_id_held"]) for name in ("reference", "vllm")}
    assert held["vllm"] == held["reference"]
    assert held["reference"][1] >= 32 > cut["reference"][1]  # not cut where the stop id was
    for name in ("reference", "vllm"):
        err = answers[name]["bad_stop_id"]["error"]
        assert err["param"] == "stop_token_ids" and "outside the vocabulary" in err["message"]


def test_special_tokens_are_said_alike_on_both(answers) -> None:
    plain = _answer(answers["reference"][PROMPTS[0]])
    for case in ("specials", "end_said", "end_unsaid"):
        got = {name: _answer(answers[name][case]) for name in ("reference", "vllm")}
        assert got["vllm"] == got["reference"], case
    assert _answer(answers["reference"]["end_unsaid"]) == plain  # the ending token unsaid
    said = _answer(answers["reference"]["end_said"])
    assert said == (plain[0] + "<|im_end|>", *plain[1:])
    past = _answer(answers["reference"]["specials"])[0]
    assert past.startswith(plain[0] + "<|im_end|>") and len(past) > len(said[0])
