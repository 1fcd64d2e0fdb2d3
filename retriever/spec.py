"""The `retrieval` field of a chat request (any process; torch-free, so the HTTP schemas can
import it without the CLIP and FAISS stack). `mpic.retriever.query.retrieve` executes it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class RetrievalSpec(BaseModel):
    """The `retrieval` field of a chat request."""

    model_config = ConfigDict(extra="forbid")

    collection: str = Field(description="Dynamic-library collection to search.")
    top_k: int = Field(3, ge=1, le=64, description="Most references to link.")
    min_score: float | None = Field(
        None, ge=-1.0, le=1.0, description="Drop hits with a lower cosine score."
    )
    mode: Literal["explicit", "auto"] = Field(
        "explicit", description="explicit: always link; auto: only when best score >= threshold."
    )
    threshold: float = Field(
        0.25, ge=-1.0, le=1.0, description="auto mode: best score needed to link anything."
    )
