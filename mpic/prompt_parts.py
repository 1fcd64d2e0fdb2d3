"""The parts a prompt is made of (every process; torch-free, so the HTTP ingress can build prompts
without importing torch): text strings and references to cached items in any order.

A cached item is an image (`ImageRef`) or a text document (`DocumentRef`: an uploaded .txt/.md
file or a passage of the dynamic library); both name the item's cache entry by its id, and
`ItemRef` matches either.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ImageRef:
    """A reference to a cached image: its entry id (content address)."""

    entry_id: str


@dataclass(frozen=True)
class DocumentRef:
    """A reference to a cached text document: its entry id (content address)."""

    entry_id: str


ItemRef = ImageRef | DocumentRef
"""A reference to any cached item."""


@dataclass(frozen=True)
class Turn:
    """Starts a new chat message with `role` ("user", "assistant" or "system"): multi-turn
    prompts. Parts before the first Turn form one user message."""

    role: str


PromptPart = str | ImageRef | DocumentRef | Turn


def item_refs(parts: list[PromptPart] | tuple[PromptPart, ...]) -> list[str]:
    """The entry ids the parts reference (images and documents), in order, repeats kept."""
    return [p.entry_id for p in parts if isinstance(p, ImageRef | DocumentRef)]


def without_items(parts: list[PromptPart]) -> list[PromptPart]:
    """The same prompt with every item part removed (what the items themselves change)."""
    return [p for p in parts if not isinstance(p, ImageRef | DocumentRef)]
