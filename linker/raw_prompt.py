"""Completion prompts (`/v1/completions`): text rendered as given, with no chat template (Serve
replica that plans a prompt: LLM worker). Same duck-typed tokenizer as `mpic.linker.prompt`.

A completion prompt is planned by the same `render_prompt_ids` as a chat, through
`RawPrompt(processor)`: a view of the model's processor whose tokenizer renders messages with
`RAW_TEMPLATE` (every message's text and document markers in order, no roles, no system prompt,
no generation prompt), so documents keep their own token ids and linked KV works alike. The first
piece is tokenized with the tokenizer's special tokens (BOS where the model has one), as vLLM's
`/v1/completions` does. Images have no place in a template-free prompt: a completion links text
and documents only (the chat route takes images).
"""

from __future__ import annotations

from typing import Any

from mpic.linker.prompt import tokenizer_of

RAW_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] != 'system' %}"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endif %}{% endfor %}"
)
"""A chat template that renders the messages' text only, concatenated as given."""


class _RawTokenizer:
    """The model's tokenizer, except that `apply_chat_template` renders `RAW_TEMPLATE`."""

    def __init__(self, tokenizer: Any) -> None:
        self._inner = tokenizer

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        kwargs["chat_template"] = RAW_TEMPLATE
        kwargs["add_generation_prompt"] = False
        return self._inner.apply_chat_template(conversation, **kwargs)

    def __call__(self, text: str, **kwargs: Any) -> Any:
        return self._inner(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class RawPrompt:
    """A processor (or tokenizer) whose `tokenizer` renders prompts without a chat template."""

    def __init__(self, processor: Any) -> None:
        self.tokenizer = _RawTokenizer(tokenizer_of(processor))
