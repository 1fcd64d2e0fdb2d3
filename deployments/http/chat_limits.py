"""Bounds on a parsed chat request (Ingress Serve replica), checked before it is resolved:
messages, content parts, text characters, and no lone UTF-16 surrogates."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mpic.errors import InvalidRequestError, PromptTooLongError


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield str(k)
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


def check_chat_shape(body: Any, limits: Any) -> None:
    """400 for a chat request over `limits` (messages, parts per message, text characters) or
    holding text that is not valid Unicode (a lone surrogate such as `\\ud800`)."""
    messages = body.messages
    if len(messages) > limits.max_messages:
        raise InvalidRequestError(
            f"{len(messages)} messages; at most {limits.max_messages} are allowed",
            param="messages",
        )
    chars = 0
    for i, msg in enumerate(messages):
        content = getattr(msg, "content", None)
        if isinstance(content, list) and len(content) > limits.max_content_parts:
            raise InvalidRequestError(
                f"message {i} has {len(content)} content parts; at most "
                f"{limits.max_content_parts} are allowed",
                param=f"messages.{i}.content",
            )
    for text in _strings(body.model_dump(exclude_none=True)):
        chars += len(text)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequestError(
                "the request holds text that is not valid Unicode (a lone surrogate)",
                param="messages",
            ) from None
    if chars > limits.max_text_chars:
        raise PromptTooLongError(
            f"the request holds {chars} characters of text; at most {limits.max_text_chars}",
            param="messages",
        )
