"""vLLM's chat-template request fields (`add_generation_prompt`, `continue_final_message`,
`chat_template_kwargs` of `/v1/chat/completions`): how a request's prompt is rendered (Ingress
checks them; the LLM worker, benchmarks and tests render with them). Torch-free, as
`mpic.linker.prompt`.

A chat prompt is planned by the same `render_prompt_ids` as ever, through
`templated(processor, options)`: a view of the model's processor whose tokenizer's
`apply_chat_template` takes the request's options (the pattern of `mpic.linker.raw_prompt`).
They apply to the request's prompt only: an item's canonical context (`canonical_context_ids`,
`document_context_ids`) is rendered from the engine's own processor, as before, and the cached
template prefix (`mpic.linker.prefix`) is matched by token ids, so another rendering just misses
it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mpic.errors import InvalidRequestError
from mpic.linker.prompt import tokenizer_of

RESERVED_KWARGS = frozenset(
    {
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "chat_template",
        "conversation",
        "messages",
        "tools",
        "documents",
        # what would change the shape of HF's answer (a string, rendered by the linker)
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
"""`chat_template_kwargs` keys that collide with the rendering's own arguments: 400."""


@dataclass(frozen=True)
class ChatTemplateOptions:
    """How a chat prompt is rendered by the model's chat template (vLLM's request fields; the
    defaults are the default rendering). InvalidRequestError (naming the field) for vLLM's
    invalid combinations, when made."""

    add_generation_prompt: bool = True
    """End the prompt with the assistant's header (false: the template's own end, no header)."""
    continue_final_message: bool = False
    """The last message (an assistant's) is left open: the model continues it (HF's
    `apply_chat_template(..., continue_final_message=True)`); needs `add_generation_prompt`
    false."""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Extra variables of the template (vLLM's `chat_template_kwargs`, e.g. `enable_thinking`);
    none of `RESERVED_KWARGS`."""

    def __post_init__(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequestError(
                "cannot set both continue_final_message and add_generation_prompt to true",
                param="continue_final_message",
            )
        if not isinstance(self.kwargs, Mapping) or not all(isinstance(k, str) for k in self.kwargs):
            raise InvalidRequestError(
                "chat_template_kwargs maps names to values", param="chat_template_kwargs"
            )
        clash = sorted(RESERVED_KWARGS & set(self.kwargs))
        if clash:
            raise InvalidRequestError(
                f"chat_template_kwargs cannot set {', '.join(clash)} (an argument of the "
                "rendering itself)",
                param="chat_template_kwargs",
            )

    @property
    def is_default(self) -> bool:
        """True when the options render as the default rendering does."""
        return self.add_generation_prompt and not self.continue_final_message and not self.kwargs


def template_options(
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> ChatTemplateOptions | None:
    """The options of vLLM's three request fields (chat completions, `/tokenize`); None for
    the default rendering. InvalidRequestError (naming the field) for vLLM's invalid
    combinations."""
    options = ChatTemplateOptions(
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        kwargs=dict(chat_template_kwargs or {}),
    )
    return None if options.is_default else options


def check_final_message(options: ChatTemplateOptions | None, last_role: str | None) -> None:
    """InvalidRequestError when `options` continue the final message and the last message
    (`last_role`) is not the assistant's."""
    if options is not None and options.continue_final_message and last_role != "assistant":
        raise InvalidRequestError(
            "continue_final_message needs the last message to be the assistant's",
            param="continue_final_message",
        )


class _TemplatedTokenizer:
    """The model's tokenizer, except that `apply_chat_template` renders with the options."""

    def __init__(self, tokenizer: Any, options: ChatTemplateOptions) -> None:
        self._inner, self._options = tokenizer, options

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        o = self._options
        if o.continue_final_message:
            last = conversation[-1]["role"] if conversation else None
            check_final_message(o, last)
        kwargs = {
            **o.kwargs,
            **kwargs,
            "add_generation_prompt": o.add_generation_prompt,
            "continue_final_message": o.continue_final_message,
        }
        try:
            return self._inner.apply_chat_template(conversation, **kwargs)
        except ValueError as exc:  # HF's own checks (e.g. no text to continue)
            if not o.continue_final_message:
                raise
            raise InvalidRequestError(
                f"continue_final_message: {str(exc).splitlines()[0]}",
                param="continue_final_message",
            ) from exc

    def __call__(self, text: str, **kwargs: Any) -> Any:
        return self._inner(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class TemplatedPrompt:
    """A processor (or tokenizer) whose `tokenizer` renders chat prompts with a request's
    `ChatTemplateOptions`."""

    def __init__(self, processor: Any, options: ChatTemplateOptions) -> None:
        self.tokenizer = _TemplatedTokenizer(tokenizer_of(processor), options)


def templated(processor: Any, options: ChatTemplateOptions | None) -> Any:
    """`processor` rendering with `options` (the processor itself for None or the defaults)."""
    if options is None or options.is_default:
        return processor
    return TemplatedPrompt(processor, options)
