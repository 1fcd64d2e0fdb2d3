"""Link plans: from a rendered, tokenized interleaved prompt to a `LinkPlan` (docs/design.md "Link
plan"; linker, runs in the Serve replica / reference runner before any KV is touched).

Input: the prompt's token ids with ONE placeholder id per item (`mpic.linker.prompt`: the image
token id per image, `DOCUMENT_PLACEHOLDER` per document) and the cache entries the placeholders
refer to, in order. Each placeholder is expanded to the entry's T tokens (an image's carry the
model's image token id, a document's its own token ids), at the positions of the family's rules
(`mpic.linker.positions`). Every token starts with recompute depth 0; a policy sets the depths.
Bad input (unknown entry, entry of another model, too long) raises a typed error here, before
anything is computed or written.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from mpic.errors import InvalidRequestError, NotFoundError, PromptTooLongError
from mpic.linker.positions import item_extent, item_positions, text_positions
from mpic.linker.prompt import DOCUMENT_PLACEHOLDER
from mpic.model_spec import ModelSpec
from mpic.types import CacheEntry, LinkPlan


def resolve_entries(
    entry_ids: Sequence[str], lookup: Mapping[str, CacheEntry] | Callable[[str], CacheEntry | None]
) -> list[CacheEntry]:
    """The entries for `entry_ids` (repeats kept); an unknown id raises NotFoundError."""
    get = lookup.get if isinstance(lookup, Mapping) else lookup
    out = []
    for entry_id in entry_ids:
        entry = get(entry_id)
        if entry is None:
            raise NotFoundError(f"no cached entry {entry_id!r}", param="entry_id")
        out.append(entry)
    return out


def linked_length(
    token_ids: Sequence[int], items: Sequence[CacheEntry], image_token_id: int | None
) -> int:
    """N, the prompt length after expanding each placeholder to its entry's T tokens.

    InvalidRequestError when the placeholders do not match the items in number or kind (an image
    reference to a document's entry or the reverse)."""
    kinds = [
        "text" if t == DOCUMENT_PLACEHOLDER else "image"
        for t in token_ids
        if t == DOCUMENT_PLACEHOLDER or t == image_token_id
    ]
    if len(kinds) != len(items):
        raise InvalidRequestError(
            f"the prompt has {len(kinds)} item placeholders but {len(items)} item references"
        )
    for kind, entry in zip(kinds, items, strict=True):
        if entry.media_type != kind:
            raise InvalidRequestError(
                f"entry {entry.entry_id!r} is a cached {entry.media_type} item, referenced as "
                f"{'a document' if kind == 'text' else 'an image'}",
                param="messages",
            )
    return len(token_ids) - len(kinds) + sum(e.num_tokens for e in items)


def item_token_ids(spec: ModelSpec, entry: CacheEntry) -> torch.Tensor:
    """int64 [T]: the prompt ids of an entry's tokens (a document's own ids, else the image id)."""
    if entry.media_type == "text":
        return torch.as_tensor(entry.extra["token_ids"], dtype=torch.int64)
    return torch.full((entry.num_tokens,), int(spec.image_token_id or 0), dtype=torch.int64)


def build_plan(
    spec: ModelSpec,
    token_ids: Sequence[int],
    items: Sequence[CacheEntry],
    max_new_tokens: int = 0,
) -> LinkPlan:
    """Expand placeholders into item tokens and lay out positions (recompute depth 0 everywhere).

    token_ids: the rendered prompt, one `spec.image_token_id` per image and one
    `DOCUMENT_PLACEHOLDER` per document; items: the entry of each placeholder in order (an
    entry may repeat). Raises PromptTooLongError when
    N + max_new_tokens > spec.max_model_len, InvalidRequestError for an entry of another model.
    """
    for entry in items:
        if entry.model_fingerprint != spec.fingerprint:
            raise InvalidRequestError(f"entry {entry.entry_id!r} was computed by another model")
    n = linked_length(token_ids, items, spec.image_token_id)
    if n + max_new_tokens > spec.max_model_len:
        raise PromptTooLongError(
            f"the linked prompt has {n} tokens (+{max_new_tokens} to generate), over the model's "
            f"maximum of {spec.max_model_len}",
            param="messages",
        )
    entry_ids: list[str] = []
    ids, pos, src, off = [], [], [], []
    next_pos, run_start, item_iter = 0, 0, iter(items)

    def flush_text(end: int) -> None:
        nonlocal next_pos
        count = end - run_start
        if count:
            ids.append(torch.tensor(token_ids[run_start:end], dtype=torch.int64))
            pos.append(text_positions(spec.family, next_pos, count))
            src.append(torch.full((count,), -1, dtype=torch.int64))
            off.append(torch.full((count,), -1, dtype=torch.int64))
            next_pos += count

    for i, tok in enumerate(token_ids):
        if tok != spec.image_token_id and tok != DOCUMENT_PLACEHOLDER:
            continue
        flush_text(i)
        run_start = i + 1
        entry = next(item_iter)
        if entry.entry_id not in entry_ids:
            entry_ids.append(entry.entry_id)
        t = entry.num_tokens
        ids.append(item_token_ids(spec, entry))
        pos.append(item_positions(spec.family, entry, next_pos))
        src.append(torch.full((t,), entry_ids.index(entry.entry_id), dtype=torch.int64))
        off.append(torch.arange(t, dtype=torch.int64))
        next_pos += item_extent(spec.family, entry)
    flush_text(len(token_ids))
    token_tensor = torch.cat(ids)
    return LinkPlan(
        token_ids=token_tensor,
        positions=torch.cat(pos, dim=-1),
        source_entry=torch.cat(src),
        source_offset=torch.cat(off),
        entry_ids=entry_ids,
        recompute_depth=torch.zeros(token_tensor.shape[0], dtype=torch.int64),
    )


def unique_entries(plan: LinkPlan, items: Sequence[CacheEntry]) -> list[CacheEntry]:
    """The entries aligned with `plan.entry_ids` (first occurrence of each)."""
    by_id = {e.entry_id: e for e in items}
    return [by_id[i] for i in plan.entry_ids]
