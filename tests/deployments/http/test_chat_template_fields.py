"""vLLM's chat-template fields of `/v1/chat/completions` over HTTP (fake engine, in-process):
`add_generation_prompt`, `continue_final_message` and `chat_template_kwargs` are accepted and
reach the engine's request as its `template` options (absent or at their defaults: none, the
default rendering); vLLM's invalid combinations are 400s naming the field."""

from __future__ import annotations

import pytest

from mpic.deployments.engines import fake_engine
from mpic.linker.chat_template import ChatTemplateOptions

ALICE = {"Authorization": "Bearer alice-key"}
USER = {"role": "user", "content": "red cat"}
ASSISTANT = {"role": "assistant", "content": "The cat is"}


@pytest.fixture
def seen(monkeypatch) -> list:
    """The `GenerateRequest.template` of every request the fake engine builds."""
    got: list = []
    real = fake_engine.generate_request

    def spy(*args, **kwargs):
        request = real(*args, **kwargs)
        got.append(request.template)
        return request

    monkeypatch.setattr(fake_engine, "generate_request", spy)
    return got


def _chat(app, messages=(USER,), **fields):
    body = {"model": "mpic", "max_tokens": 4, "messages": list(messages), **fields}
    return app.client.post("/v1/chat/completions", json=body, headers=ALICE)


def _param(resp) -> str:
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]["param"]


def test_each_field_is_accepted_and_reaches_the_engine(fake_app, seen) -> None:
    cases = [
        ({}, None),
        ({"add_generation_prompt": True, "continue_final_message": False}, None),
        ({"chat_template_kwargs": {}}, None),
        ({"add_generation_prompt": False}, ChatTemplateOptions(add_generation_prompt=False)),
        (
            {"chat_template_kwargs": {"enable_thinking": False}},
            ChatTemplateOptions(kwargs={"enable_thinking": False}),
        ),
    ]
    for fields, want in cases:
        r = _chat(fake_app, **fields)
        assert r.status_code == 200, (fields, r.text)
        assert seen[-1] == want, fields
    r = _chat(fake_app, [USER, ASSISTANT], add_generation_prompt=False, continue_final_message=True)
    assert r.status_code == 200, r.text
    assert seen[-1] == ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True)


def test_streamed_and_several_choices_carry_the_options(fake_app, seen) -> None:
    r = _chat(fake_app, add_generation_prompt=False, n=2, stream=True)
    assert r.status_code == 200, r.text
    assert seen == [ChatTemplateOptions(add_generation_prompt=False)] * 2


def test_continue_final_message_with_add_generation_prompt_is_a_400(fake_app) -> None:
    # add_generation_prompt defaults to true, as in vLLM: continuing needs it false
    for fields in (
        {"continue_final_message": True},
        {"continue_final_message": True, "add_generation_prompt": True},
    ):
        r = _chat(fake_app, [USER, ASSISTANT], **fields)
        assert _param(r) == "continue_final_message"
        assert "add_generation_prompt" in r.json()["error"]["message"]


def test_continue_final_message_needs_an_assistant_message_last(fake_app) -> None:
    for messages in ([USER], [ASSISTANT, USER], [{"role": "system", "content": "be brief"}]):
        r = _chat(fake_app, messages, add_generation_prompt=False, continue_final_message=True)
        assert _param(r) == "continue_final_message", messages
        assert "assistant" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "key",
    [
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "chat_template",
        "conversation",
        "messages",
        "tools",
        "documents",
    ],
)
def test_chat_template_kwargs_cannot_set_the_renderings_own_arguments(fake_app, key) -> None:
    r = _chat(fake_app, chat_template_kwargs={key: False, "enable_thinking": False})
    assert _param(r) == "chat_template_kwargs"
    assert key in r.json()["error"]["message"]


def test_the_fields_are_strictly_typed(fake_app) -> None:
    for name, bad in (
        ("add_generation_prompt", "no"),
        ("add_generation_prompt", 0),
        ("continue_final_message", 1),
        ("chat_template_kwargs", ["enable_thinking"]),
        ("chat_template_kwargs", "enable_thinking=false"),
    ):
        assert _param(_chat(fake_app, **{name: bad})) == name, (name, bad)


def test_completions_take_no_chat_template_fields(fake_app) -> None:
    body = {"model": "mpic", "prompt": "red cat", "max_tokens": 4, "add_generation_prompt": False}
    r = fake_app.client.post("/v1/completions", json=body, headers=ALICE)
    assert _param(r) == "add_generation_prompt"
