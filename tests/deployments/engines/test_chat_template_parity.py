"""vLLM's chat-template fields give the same greedy answers on both engines over HTTP: the
reference engine and the vLLM worker (in-process apps, no Ray, the same tiny Qwen2-VL and store;
text-only chats under `full`) answer a chat rendered with `add_generation_prompt: false` and one
continuing its last (assistant) message with `continue_final_message: true` with the same text
and token counts; each prompt is shorter than the default rendering's (no assistant header; the
open message's end and the header cut), and its answer differs from the default's. The live
fidelity monitor's exact pass renders the prompt as the served request did: on a chat served
under a linking policy (nothing to link: the served pass is exact), its sampled first-token KL
is ~0 and its answer agrees."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.deployments.conftest import ADMIN_KEY, KEYS
from tests.deployments.inprocess import InProcessApp, fake_config, in_process_app

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
SHADOW_TOKENS = 8
ALICE = {"Authorization": "Bearer alice-key"}
USER = {"role": "user", "content": "dog blue"}
OPEN = [USER, {"role": "assistant", "content": "red two blue"}]
"""The conversation continued: the assistant's last message is left open."""

CHATS: dict[str, tuple[list[dict], dict]] = {
    "default": ([USER], {}),
    "no_header": ([USER], {"add_generation_prompt": False}),
    "closed": (OPEN, {}),
    "continue": (OPEN, {"add_generation_prompt": False, "continue_final_message": True}),
}
"""name -> (messages, chat-template fields); "default" and "closed" are the default renderings
of the same messages as "no_header" and "continue"."""


@pytest.fixture(scope="module")
def answers(tiny_qwen2vl_dir: Path, tmp_path_factory) -> dict[str, dict[str, Any]]:
    """engine -> chat name -> the chat's JSON, and under "shadow": chat name -> the fidelity
    monitor's sample of that chat served under `mpic-32`. The apps are opened one after the
    other (an in-process app opened inside another takes its routes over)."""
    from mpic.deployments.config import FidelityConfig

    store = tmp_path_factory.mktemp("template-store")
    fidelity = FidelityConfig(sample_rate=1.0, idle_s=0.0, answer_tokens=SHADOW_TOKENS)
    out: dict[str, dict[str, Any]] = {}
    for kind, extra in (("reference", {}), ("vllm", {"max_model_len": 1024})):
        cfg = fake_config(store, kind=kind, model=str(tiny_qwen2vl_dir), **extra)
        cfg = cfg.model_copy(update={"fidelity": fidelity})
        with in_process_app(cfg, KEYS, [ADMIN_KEY]) as app:
            out[kind] = {name: _chat(app, *chat) for name, chat in CHATS.items()}
            out[kind]["shadow"] = {name: _shadow(app, name) for name in ("no_header", "continue")}
    return out


def _shadow(app: InProcessApp, name: str) -> Any:
    """The fidelity sample of chat `name` served under `mpic-32` (sampled: not `full`)."""
    messages, fields = CHATS[name]
    rid = f"shadow-{name}"
    body = {
        **fields,
        "model": "mpic",
        "max_tokens": SHADOW_TOKENS,
        "mpic": {"policy": "mpic-32"},
        "messages": messages,
    }
    headers = {**ALICE, "X-Request-ID": rid}
    resp = app.client.post("/v1/chat/completions", json=body, headers=headers, timeout=600)
    assert resp.status_code == 200, resp.text
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        for sample in list(app.worker.fidelity.samples):
            if sample.request_id == rid:
                return sample
        time.sleep(0.05)
    raise AssertionError(f"no fidelity sample for {rid}: {app.worker.fidelity.stats()}")


def _chat(app: InProcessApp, messages: list[dict], fields: dict) -> dict:
    body = {
        **fields,
        "model": "mpic",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "mpic": {"policy": "full"},
        "messages": messages,
    }
    resp = app.client.post("/v1/chat/completions", json=body, headers=ALICE, timeout=600)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _answer(out: dict) -> tuple[str, int, int]:
    usage, text = out["usage"], out["choices"][0]["message"]["content"]
    return text, usage["prompt_tokens"], usage["completion_tokens"]


@pytest.mark.parametrize("name", ["no_header", "continue"])
def test_the_same_greedy_answer_on_both_engines(answers, name: str) -> None:
    assert _answer(answers["vllm"][name]) == _answer(answers["reference"][name])


HEADER = "<|im_start|>assistant\n"
"""Qwen2-VL's assistant header, which the default rendering ends the prompt with."""


@pytest.mark.parametrize(
    ("name", "default", "dropped"),
    [("no_header", "default", HEADER), ("continue", "closed", "<|im_end|>\n" + HEADER)],
)
def test_the_fields_change_the_prompt_and_the_answer(
    answers, tiny_qwen2vl_dir: Path, name: str, default: str, dropped: str
) -> None:
    """The prompt loses the assistant header; continuing also loses the open message's end."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2vl_dir)
    fewer = len(tokenizer(dropped, add_special_tokens=False)["input_ids"])
    for kind in ("reference", "vllm"):
        text, prompt_tokens, _ = _answer(answers[kind][name])
        plain_text, plain_tokens, _ = _answer(answers[kind][default])
        assert prompt_tokens == plain_tokens - fewer, kind
        assert text != plain_text, kind


@pytest.mark.parametrize("name", ["no_header", "continue"])
def test_the_fidelity_shadow_renders_as_the_served_request(answers, name: str) -> None:
    for kind in ("reference", "vllm"):
        sample = answers[kind]["shadow"][name]
        assert sample.kl < 1e-3, (kind, sample)
        assert sample.top1_agree and sample.answer_agreement == 1.0, (kind, sample)
