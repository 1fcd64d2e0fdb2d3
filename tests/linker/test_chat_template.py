"""A request's chat-template options (`mpic.linker.chat_template`, vLLM's
`add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`): the prompt ids the
linker renders with them (a text-only prompt) are the HF tokenizer's own
`apply_chat_template(..., tokenize=True)` ids for the same messages with the same arguments, and
differ from the default rendering; the defaults render as before; vLLM's invalid combinations
are InvalidRequestErrors naming the field; items' canonical contexts ignore the options."""

from __future__ import annotations

from pathlib import Path

import pytest

from mpic.errors import InvalidRequestError
from mpic.linker.chat_template import ChatTemplateOptions, templated
from mpic.linker.prompt import document_context_ids, render_prompt_ids
from mpic.prompt_parts import Turn

THINKING = (
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
)
"""Qwen3's switch, appended to the tiny models' templates: rendered only when the request passes
`enable_thinking: false` (a template variable, vLLM's `chat_template_kwargs`)."""


@pytest.fixture(params=["llava", "qwen2-vl"])
def tokenizer(request, tiny_llava_dir: Path, tiny_qwen2vl_dir: Path):
    from transformers import AutoTokenizer

    folder = tiny_llava_dir if request.param == "llava" else tiny_qwen2vl_dir
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = tok.chat_template + THINKING
    return tok


def _typed(text: str) -> list[dict]:
    return [{"type": "text", "text": text}]


PARTS = ["What colour is the sky?", Turn("assistant"), "The sky is"]
MESSAGES = [
    {"role": "system", "content": _typed("Be brief.")},
    {"role": "user", "content": _typed("What colour is the sky?")},
    {"role": "assistant", "content": _typed("The sky is")},
]


def _hf(tokenizer, **kwargs) -> list[int]:
    """HF's own rendering and tokenization of MESSAGES."""
    ids = tokenizer.apply_chat_template(MESSAGES, tokenize=True, return_dict=False, **kwargs)
    return list(ids)


def _ours(tokenizer, options: ChatTemplateOptions | None) -> list[int]:
    return render_prompt_ids(templated(tokenizer, options), PARTS, "Be brief.")


CASES = [
    ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
    (
        {"add_generation_prompt": False, "continue_final_message": True},
        {"add_generation_prompt": False, "continue_final_message": True},
    ),
    (
        {"kwargs": {"enable_thinking": False}},
        {"add_generation_prompt": True, "enable_thinking": False},
    ),
]


@pytest.mark.parametrize(("options", "hf_kwargs"), CASES, ids=["no-header", "continue", "kwargs"])
def test_each_option_renders_as_hf_does(tokenizer, options, hf_kwargs) -> None:
    got = _ours(tokenizer, ChatTemplateOptions(**options))
    assert got == _hf(tokenizer, **hf_kwargs)
    assert got != _ours(tokenizer, None)  # the option changed the prompt


def test_the_defaults_render_as_before(tokenizer) -> None:
    default = _hf(tokenizer, add_generation_prompt=True)
    assert _ours(tokenizer, None) == default
    assert _ours(tokenizer, ChatTemplateOptions()) == default
    assert templated(tokenizer, ChatTemplateOptions()) is tokenizer
    assert templated(tokenizer, None) is tokenizer


def test_continuing_leaves_the_assistant_message_open(tokenizer) -> None:
    options = ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True)
    ids = _ours(tokenizer, options)
    closed = _ours(tokenizer, ChatTemplateOptions(add_generation_prompt=False))
    assert tokenizer.decode(ids).endswith("The sky is")
    assert closed[: len(ids)] == ids and len(closed) > len(ids)  # only the message's end cut


def test_continuing_needs_the_assistant_last() -> None:
    class Refusing:  # the view checks before the template renders
        chat_template = "{{ messages }}"

        def apply_chat_template(self, conversation, **kwargs):
            raise AssertionError("rendered a prompt whose last message is not the assistant's")

    options = ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(InvalidRequestError) as exc:
        render_prompt_ids(templated(Refusing(), options), ["hi"], None)
    assert exc.value.param == "continue_final_message"


def test_invalid_combinations_name_the_field() -> None:
    with pytest.raises(InvalidRequestError) as exc:
        ChatTemplateOptions(continue_final_message=True)  # add_generation_prompt defaults true
    assert exc.value.param == "continue_final_message"
    for key in ("add_generation_prompt", "tokenize", "chat_template", "messages", "documents"):
        with pytest.raises(InvalidRequestError) as exc:
            ChatTemplateOptions(kwargs={key: False})
        assert exc.value.param == "chat_template_kwargs" and key in str(exc.value)


def test_the_canonical_context_ignores_the_options(tokenizer) -> None:
    """Items are cached in the engine's own rendering: the options reach the prompt only."""
    before = document_context_ids(tokenizer, "Be brief.")
    _ours(tokenizer, ChatTemplateOptions(add_generation_prompt=False, kwargs={"x": 1}))
    assert document_context_ids(tokenizer, "Be brief.") == before
