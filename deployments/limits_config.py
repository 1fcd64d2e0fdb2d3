"""The request limits of the application (CLI process and every Serve replica that enforces
them): upload and body sizes, chat shape, image headers, the LLM worker's generation budget, and
the ingress's TTFT shedding (`limits:` in the serving config).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class LimitsConfig(BaseModel):
    """Upload and request limits enforced by the ingress."""

    model_config = ConfigDict(extra="forbid")

    max_upload_bytes: int = Field(
        8 << 20, ge=1, description="Larger uploads get HTTP 413 (counted while reading)."
    )
    max_body_bytes: int = Field(
        16 << 20,
        ge=1,
        description="Larger request bodies (JSON routes, inline images included) get HTTP 413, "
        "counted while reading.",
    )
    max_messages: int = Field(256, ge=1, description="Messages per chat request (else 400).")
    max_content_parts: int = Field(64, ge=1, description="Content parts per message (else 400).")
    max_text_chars: int = Field(
        262144,
        ge=1,
        description="Characters of text per chat request (else 400, before any tokenization).",
    )
    max_image_pixels: int = Field(
        16 << 20,
        ge=1,
        description="Pixels per image, read from its header before decoding (else HTTP 413).",
    )
    max_image_side: int = Field(
        8192, ge=1, description="Pixels per image side, read from its header (else HTTP 400)."
    )
    max_image_aspect_ratio: float = Field(
        20.0,
        ge=1,
        description="Longest over shortest side, read from the header before any decode or "
        "resize (else HTTP 400): a 100,000 x 1 image is under the pixel limit, but a processor "
        "that scales its short side up to the model's size would allocate gigabytes.",
    )
    max_requests_in_flight: int = Field(
        32,
        ge=1,
        description="Generations one LLM-worker replica runs at once (else HTTP 429 "
        "engine_overloaded); with the vLLM engine at most max_num_seqs + engine_queue_seqs.",
    )
    engine_queue_seqs: int | None = Field(
        None,
        ge=0,
        description="vLLM engine: requests one LLM-worker replica lets wait in vLLM's queue "
        "beside the max_num_seqs it runs (past them HTTP 429 engine_overloaded, not a wait past "
        "the TTFT target); None: max_num_seqs (one batch waits).",
    )
    max_tokens_in_flight: int = Field(
        65536,
        ge=1,
        description="Estimated prompt + max_tokens of the generations one LLM-worker replica "
        "runs at once (else HTTP 429).",
    )
    retry_after_s: int = Field(
        1,
        ge=1,
        description="The least Retry-After of a 429 from the LLM worker's budget; it announces "
        "its estimate of when a slot frees (mean generation time / requests in flight) when "
        "that is longer.",
    )
    ttft_target_s: float = Field(
        10.0,
        ge=0,
        description="TTFT the ingress keeps admitted generations under: a request is admitted "
        "while those waiting for their first token are fewer than ttft_target_s x the measured "
        "first-token rate (Little's law, mpic.deployments.http.shedding), else HTTP 429 "
        "server_overloaded with Retry-After; 0: no shedding by the ingress.",
    )
    ttft_headroom: float = Field(
        0.2,
        ge=0,
        lt=1,
        description="Share of ttft_target_s the ingress leaves to what it cannot time: a "
        "request's way to it (the client, the network, Serve's proxy). Admission keeps the "
        "TTFT it times under ttft_target_s x (1 - ttft_headroom).",
    )
    shed_initial_rate: float = Field(
        2.0, gt=0, description="First tokens per second assumed until the rate is measured."
    )
    max_pending_requests: int = Field(
        1024,
        ge=1,
        description="Most requests one ingress replica holds; its Serve max_ongoing_requests is "
        "raised to this so the application, not Serve's proxy, sheds (with a JSON body).",
    )
