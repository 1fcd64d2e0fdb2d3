"""Data contracts shared by linker, engine, storage and deployments (docs/design.md "Contracts").

Runs in every process. Only torch and the standard library are imported here, so storage, linker
and retriever code can use these types without vLLM.

Decision (README "Design choices"): cached keys are stored AFTER RoPE, at the positions they were
computed at in the canonical context. Linking at another position rotates them by
R(p_new - p_old) (LMCache's scheme); linking at the same position needs no rotation, so the
"same place, same context" oracle is bit-exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

ModelFamily = Literal["llava", "llava-next", "qwen2-vl", "qwen2.5-vl", "llama", "qwen2"]
"""1-D RoPE (LLaVA / Llama / Mistral backbones) or M-RoPE (Qwen2-VL, 3-D positions); `llama` and
`qwen2` are text-only causal LMs (1-D RoPE) whose cached items are text documents."""

MROPE_FAMILIES: tuple[str, ...] = ("qwen2-vl", "qwen2.5-vl")
"""Families with M-RoPE (3-D positions [3, N]); the others use 1-D RoPE."""

TEXT_FAMILIES: tuple[str, ...] = ("llama", "qwen2")
"""Families without a vision tower: their prompts hold text and documents only."""


@dataclass
class CacheEntry:
    """The KV of one media item computed in the canonical context (system prompt + item).

    Content-addressed: `entry_id` is sha256 over (model fingerprint, canonical context, media
    bytes). `L` layers, `T` item tokens, `H_kv` KV heads, `D` head size.
    """

    entry_id: str
    model_fingerprint: str
    keys: torch.Tensor
    """[L, T, H_kv, D], post-RoPE at `positions`."""
    values: torch.Tensor
    """[L, T, H_kv, D]."""
    positions: torch.Tensor
    """int64 [T] (1-D RoPE) or [3, T] (M-RoPE: temporal, height, width) in the canonical context."""
    input_embeds: torch.Tensor
    """[T, hidden]: the item's input embeddings (vision tower + projector), used to recompute any
    of its tokens without running the vision tower again."""
    media_type: str = "image"
    """"image", or "text" for a document (its token ids in `extra["token_ids"]`)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Family-specific metadata, e.g. {"image_grid_thw": [t, h, w]} for Qwen2-VL."""

    @property
    def num_tokens(self) -> int:
        """T, the number of item tokens."""
        return int(self.keys.shape[1])

    @property
    def start_position(self) -> int:
        """The (text) position of the item's first token in the canonical context."""
        return int(self.positions.min())

    @property
    def position_extent(self) -> int:
        """How far the item advances the text position: T for 1-D RoPE; for M-RoPE
        max(position) - start + 1 (Qwen2-VL continues text at max + 1 after an image)."""
        return int(self.positions.max()) - self.start_position + 1


@dataclass
class LinkPlan:
    """How a prompt of N tokens is built from text and cached entries (docs/design.md "Link plan").

    Text tokens have no stored KV: their slots are the dummy (zero) cache and they are always
    recomputed. A token's `recompute_depth` is the number of leading layers at which it is
    recomputed: 0 = reused at every layer, L = recomputed at every layer. MPIC-k, CacheBlend and
    full recompute use only 0 or L; VLCache's non-increasing per-layer ratios use values between
    (a token dropped at layer l skips attention and MLP from layer l on, VLCache section 4.1).
    """

    token_ids: torch.Tensor
    """int64 [N]; image tokens carry the model's image placeholder id, document tokens their own
    token ids (`CacheEntry.extra["token_ids"]`)."""
    positions: torch.Tensor
    """int64 [N] (1-D RoPE) or [3, N] (M-RoPE): the positions in THIS prompt."""
    source_entry: torch.Tensor
    """int64 [N]: index into `entry_ids`, or -1 for text."""
    source_offset: torch.Tensor
    """int64 [N]: token offset inside the entry, or -1 for text."""
    entry_ids: list[str]
    """The entries the plan links, in order of first appearance (an entry may appear twice)."""
    recompute_depth: torch.Tensor
    """int64 [N]: leading layers at which each token is recomputed (set by a policy)."""

    @property
    def num_tokens(self) -> int:
        """N, the prompt length."""
        return int(self.token_ids.shape[0])

    @property
    def is_text(self) -> torch.Tensor:
        """bool [N]: True where the token is text (no stored KV)."""
        return self.source_entry < 0

    def recompute_mask(self, layer: int) -> torch.Tensor:
        """bool [N]: the tokens recomputed at `layer`."""
        return self.recompute_depth > layer
