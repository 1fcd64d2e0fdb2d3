"""Retrieval inside a chat query (MPIC section 3.1, workflow step 4: "the retriever executes MRAG
when triggered"): a request's `retrieval` field becomes dynamic-library references that the linker
links like uploaded files. Runs in the Serve replica that prepares link plans (Resolver/Retriever).

The query is the last user turn: its text, its images (inline or uploaded files), or both,
embedded by the collection's CLIP model into one vector.

Two modes:
- explicit: `{"collection", "top_k", "min_score"}` always retrieves; hits under `min_score` drop.
- auto: retrieves, but links the hits only when the best score reaches `threshold` (the query is
  close enough to the library to be worth extending the prompt; otherwise nothing is linked).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from mpic.errors import InvalidRequestError
from mpic.retriever.service import Hit, RetrievalService
from mpic.retriever.spec import RetrievalSpec


class Retrieved(BaseModel):
    """References to link, best first, all from one collection version."""

    collection: str = Field(description="Collection searched.")
    version: str | None = Field(description="Version searched (None when nothing was searched).")
    triggered: bool = Field(description="False when auto mode found nothing close enough.")
    hits: list[Hit] = Field(description="Linked references in score order.")

    @property
    def entry_keys(self) -> list[str]:
        """Cache-entry keys of the hits, best first (what the linker loads)."""
        return [h.entry_key for h in self.hits if h.entry_key]


def retrieve(
    retriever: RetrievalService,
    spec: RetrievalSpec,
    *,
    text: str | None = None,
    image: bytes | None = None,
    images: list[bytes] | None = None,
) -> Retrieved:
    """Search `spec.collection` with the query's text, its image(s), or both (one combined
    query vector, `RetrievalService.search`) and apply the mode.

    NotFoundError for an unknown collection; InvalidRequestError for an empty query.
    """
    pictures = [*([image] if image is not None else []), *(images or [])]
    query_text = text if text and text.strip() else None
    if query_text is None and not pictures:
        raise InvalidRequestError("retrieval needs query text or an image", param="retrieval")
    result = retriever.search(
        spec.collection,
        text=query_text,
        images=pictures,
        top_k=spec.top_k,
        min_score=spec.min_score,
    )
    best = max((h.score for h in result.hits), default=None)
    triggered = spec.mode == "explicit" or (best is not None and best >= spec.threshold)
    return Retrieved(
        collection=result.collection,
        version=result.version,
        triggered=triggered,
        hits=result.hits if triggered else [],
    )
