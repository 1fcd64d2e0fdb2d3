"""The parts a prompt is made of (every process; torch-free, so the HTTP ingress can build prompts
without importing torch): text strings and references to cached items in any order."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ImageRef:
    """A reference to a cached image: its entry id (content address)."""

    entry_id: str


PromptPart = str | ImageRef
