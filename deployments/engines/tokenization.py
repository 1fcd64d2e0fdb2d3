"""vLLM's `/tokenize` and `/detokenize` on the served model's tokenizer (LLM-worker Serve
replica). Text prompts are tokenized as `/v1/completions` plans them (the tokenizer's special
tokens added by default, vLLM's `add_special_tokens: true`); chat messages as
`/v1/chat/completions` renders them (the model's chat template with the server's system prompt,
one placeholder id per image, `mpic.linker.prompt.render_prompt_ids`), so `count` is the prompt
length a text chat is charged. A model-free engine (the fake one) tokenizes UTF-8 bytes.
"""

from __future__ import annotations

from typing import Any

from mpic.errors import InvalidRequestError
from mpic.linker.chat_template import ChatTemplateOptions, templated
from mpic.linker.prompt import render_prompt_ids
from mpic.prompt_parts import PromptPart, Turn


def tokenize_text(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a plain text prompt (UTF-8 bytes without a tokenizer)."""
    if tokenizer is None:
        return list(text.encode())
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def tokenize_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    default_system: str | None,
    template: ChatTemplateOptions | None = None,
) -> list[int]:
    """Token ids of text chat messages ({"role", "content": str or text parts}) rendered as the
    chat route renders them: the first system/developer message is the system prompt (else
    `default_system`), every other message one turn; `template`: the request's chat-template
    options (None: the default rendering). InvalidRequestError for a non-text part."""
    system, parts = default_system, []
    for i, msg in enumerate(messages):
        role = "system" if msg["role"] == "developer" else msg["role"]
        content = msg["content"]
        texts = [content] if isinstance(content, str) else []
        for j, part in enumerate([] if isinstance(content, str) else content):
            if part.get("type") != "text":
                raise InvalidRequestError(
                    "tokenize counts text messages only (images and files are linked, their "
                    "token counts are in the files' `tokens`)",
                    param=f"messages.{i}.content.{j}",
                )
            texts.append(part["text"])
        if role == "system" and i == 0:
            system = "".join(texts)
            continue
        parts.extend([Turn(role), *texts])
    if tokenizer is None:
        return list("".join(p for p in parts if isinstance(p, str)).encode())
    rendered: list[PromptPart] = parts
    if (
        rendered
        and rendered[0] == Turn("user")
        and not any(isinstance(p, Turn) for p in rendered[1:])
    ):
        rendered = rendered[1:]  # one user message: rendered as the chat route renders it
    return render_prompt_ids(templated(tokenizer, template), rendered, system)


def detokenize(tokenizer: Any, tokens: list[int]) -> str:
    """The text of `tokens` (vLLM's `/detokenize`); InvalidRequestError for an id outside the
    vocabulary."""
    if tokenizer is None:
        if any(not 0 <= t < 256 for t in tokens):
            raise InvalidRequestError("token ids are bytes (0-255) here", param="tokens")
        return bytes(tokens).decode(errors="replace")
    vocab = len(tokenizer)
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(
            f"token id {bad[0]} is outside the vocabulary ({vocab} tokens)", param="tokens"
        )
    return tokenizer.decode(tokens)
