"""Serving's own steps before an engine runs (Encoder and LLM-worker replicas): identifying an
uploaded image and chat turns -> the linker's prompt parts. Every `ServeEngine` uses them; the
rest of a request's flow (plan, sampling, stop strings, detokenizing, the cached-token count) is
the engines' own, in `mpic.engine.request_flow` and its neighbours (re-exported here).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from mpic.deployments.messages import EncodedImage, LinkedPrompt
from mpic.engine.detokenize import Detokenizer, StopMatcher, token_events
from mpic.engine.items import load_image
from mpic.engine.protocol import GenerateRequest
from mpic.engine.request_flow import INLINE_PREFIX, stored_linked_tokens
from mpic.engine.sampling import Sampler
from mpic.prompt_parts import DocumentRef, ImageRef, PromptPart, Turn
from mpic.types import CacheEntry

if TYPE_CHECKING:
    from mpic.linker.policies import Policy

__all__ = [
    "INLINE_PREFIX",
    "Detokenizer",
    "Sampler",
    "StopMatcher",
    "generate_request",
    "identify_image",
    "prompt_parts",
    "served_policy",
    "stored_linked_tokens",
    "token_events",
]


def identify_image(media: bytes) -> tuple[str, str]:
    """(sha256 hex, MIME type) of an image; UnreadableMediaError (415) if it does not decode."""
    from PIL import Image

    load_image(media)
    with Image.open(io.BytesIO(media)) as img:
        return hashlib.sha256(media).hexdigest(), f"image/{(img.format or 'unknown').lower()}"


def prompt_parts(
    prompt: LinkedPrompt, system_prompt: str | None, inline_entry: Callable[[EncodedImage], str]
) -> tuple[str | None, list[PromptPart]]:
    """(system prompt, parts) of a conversation: the first system (or developer) message is the
    system prompt (default `system_prompt`); every other message starts with a `Turn(role)`
    part followed by its text strings and ImageRefs, so the chat template renders each turn
    with its own role and the images of every turn are linked where they now stand (MPIC is
    position-independent: a follow-up question reuses the KV of earlier turns' images).
    `inline_entry(image)` makes an inline image linkable and returns its entry id."""
    parts: list[PromptPart] = []
    for i, turn in enumerate(prompt.turns):
        role = "system" if turn.role == "developer" else turn.role
        if role == "system" and i == 0:
            system_prompt = "".join(s.text for s in turn.segments)
            continue
        parts.append(Turn(role))
        for seg in turn.segments:
            if seg.kind == "text":
                parts.append(seg.text)
            elif seg.kind == "inline":
                parts.append(ImageRef(inline_entry(seg.embeds)))
            elif seg.document:
                parts.append(DocumentRef(seg.entry_id))
            else:
                parts.append(ImageRef(seg.entry_id))
    if parts and parts[0] == Turn("user") and not any(isinstance(p, Turn) for p in parts[1:]):
        parts = parts[1:]  # one user message: the plain prompt (offline runner's rendering)
    return system_prompt, parts


def generate_request(
    prompt: LinkedPrompt,
    system_prompt: str | None,
    entries: Mapping[str, CacheEntry],
    inline_entry: Callable[[EncodedImage], CacheEntry],
    media: Mapping[str, bytes | Callable[[], bytes]] | None = None,
    scales: Sequence[Sequence[float]] | None = None,
) -> GenerateRequest:
    """The engine request of a served prompt: its parts (`prompt_parts`; `system_prompt` unless
    the conversation has its own), linking `entries` and its inline images' entries
    (`inline_entry(image)`, computed for this request alone), and every request field
    (policy, sampling, max_tokens, completion form, chat template options, press, fidelity
    capture). media: what an exact fallback reads (entry id -> bytes or a reader), where the
    engine has one.

    The policy is the one the Resolver parsed (`LinkedPrompt.parsed_policy`), under the served
    model's own scout table `scales` (`Policy.with_scales`: what parsing its name against the
    model gives, without parsing it again); a prompt without one hands the engine its name."""
    table = dict(entries)

    def inline(image: EncodedImage) -> str:
        entry = inline_entry(image)
        table[entry.entry_id] = entry
        return entry.entry_id

    system, parts = prompt_parts(prompt, system_prompt, inline)
    return GenerateRequest(
        parts=parts,
        entries=table,
        policy=served_policy(prompt, scales),
        sampling=prompt.sampling,
        max_tokens=prompt.max_tokens,
        system_prompt=system,
        raw=prompt.raw,
        template=prompt.template,
        press=prompt.press,
        budget=prompt.budget,
        exact_decode=prompt.exact_decode,
        media=media,
        capture_first_token=prompt.capture_first_token,
        request_id=prompt.request_id,
    )


def served_policy(
    prompt: LinkedPrompt, scales: Sequence[Sequence[float]] | None = None
) -> str | Policy:
    """The policy an engine serves `prompt` by: the Resolver's parsed `Policy` under the model's
    scout table `scales`, else (a prompt built without the Resolver) its name."""
    if prompt.parsed_policy is None:
        return prompt.policy
    return prompt.parsed_policy.get().with_scales(scales)
