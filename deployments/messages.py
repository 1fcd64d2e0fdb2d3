"""Messages between the Serve deployments (Ingress, Resolver, Encoder, LLM worker; any replica).

Torch-free, so the HTTP ingress can import them without loading torch: an `EncodedImage` carries
a tensor from the Encoder to the LLM worker, but only its type is named here. The Resolver hands
the worker a `LinkedPrompt` (chat turns with every file reference resolved to a content-addressed
entry id in the caller's namespace, and the policy it parsed, as a `CarriedPolicy`); the worker
streams `TokenEvent`s, then one `DoneEvent` (the engines' vocabulary, `mpic.engine.protocol`,
re-exported here with `Sampling`).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from mpic.engine.protocol import DoneEvent, Sampling, TokenEvent, TokenLogprob

if TYPE_CHECKING:
    import torch

    from mpic.linker.chat_template import ChatTemplateOptions
    from mpic.linker.policies import Policy


class CarriedPolicy:
    """A parsed `mpic.linker.policies.Policy` on its way from the Resolver, which parsed it, to
    the LLM worker, through the Ingress (Ray pickles what the deployments hand each other).

    It pickles as the policy's own pickle, made once, and unpickles to those bytes alone: the
    policy object is rebuilt only where `get` is called (the worker), so the torch-free Ingress
    relays it without importing the linker (or torch). Immutable: copies of a prompt share it."""

    __slots__ = ("_blob", "_policy")

    def __init__(self, policy: Policy | None = None, blob: bytes | None = None) -> None:
        if (policy is None) == (blob is None):
            raise ValueError("a CarriedPolicy holds a policy or its pickle")
        self._policy, self._blob = policy, blob

    def get(self) -> Policy:
        """The policy (unpickled on the first call in this process; never parsed again)."""
        if self._policy is None:
            self._policy = pickle.loads(self._blob)  # noqa: S301 - from the Resolver replica
        return self._policy

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        if self._blob is None:
            self._blob = pickle.dumps(self._policy, protocol=pickle.HIGHEST_PROTOCOL)
        return _carried, (self._blob,)

    def __repr__(self) -> str:
        shown = self._policy.name if self._policy is not None else "(pickled)"
        return f"CarriedPolicy({shown})"


def _carried(blob: bytes) -> CarriedPolicy:
    """A `CarriedPolicy` from its pickle (the policy is rebuilt only on `get`)."""
    return CarriedPolicy(blob=blob)


@dataclass
class Segment:
    """One piece of a turn: text, a cached entry (linked), or an inline image (recomputed)."""

    kind: Literal["text", "entry", "inline"]
    text: str = ""
    entry_id: str = ""
    """`entry` only: the content-addressed entry id."""
    content_hash: str = ""
    """`entry` only: sha256 of the media, to recompute the entry if it is lost (a fallback)."""
    file_id: str = ""
    """`entry` from a file part: the caller's file id (logged when the entry falls back)."""
    document: bool = False
    """`entry` only: the item is a text document (an uploaded .txt/.md file), not an image."""
    embeds: Any = None
    """`inline` only: the `EncodedImage` (a Ray ObjectRef in transit, owned by the ingress that
    asked the Encoder: `mpic.deployments.serve.inline`)."""
    media: bytes = b""
    """`inline` only: the image bytes as sent (the worker re-encodes them if the Encoder's
    result is lost in transit)."""


@dataclass
class LinkedTurn:
    """One chat message after resolution."""

    role: str
    segments: list[Segment]


@dataclass
class LinkedPrompt:
    """What the worker generates from: resolved turns, policy, decoding budget."""

    turns: list[LinkedTurn]
    policy: str
    """The name of the policy the request is served by, as resolved (`mpic.policy`, the budget's
    `auto-<b>` or the server's default): what responses and metrics report."""
    max_tokens: int
    retrieved: list[str] = field(default_factory=list)
    """Entry ids the retriever added (reported back to the client)."""
    sampling: Sampling = field(default_factory=Sampling)
    request_id: str = ""
    """The ingress's request id (logged by every deployment that handles the request)."""
    press: str | None = None
    """KV press applied after the prefill (`mpic.presses`), None for none."""
    budget: float | None = None
    """The press's budget, a fraction of the prompt's KV in (0, 1]."""
    exact_decode: bool = False
    """Decode after the first token over the exact KV (`GenerateRequest.exact_decode`)."""
    raw: bool = False
    """A completion prompt (`/v1/completions`): rendered without the chat template
    (`mpic.linker.raw_prompt`); text and documents only."""
    template: ChatTemplateOptions | None = None
    """How the chat template renders the prompt (vLLM's `add_generation_prompt`,
    `continue_final_message`, `chat_template_kwargs`: `GenerateRequest.template`); None: the
    default rendering."""
    policy_defaulted: bool = False
    """The request named neither a policy nor a recompute budget: the server's default applies
    (the fidelity loop may move it, `mpic.deployments.monitoring.fidelity_monitor`)."""
    parsed_policy: CarriedPolicy | None = None
    """`policy` parsed and checked, once, by the Resolver (`mpic.deployments.serve.policy_check`);
    the worker serves it without parsing the name again. None: a prompt built elsewhere (tests,
    tools), whose name the engine parses."""
    capture_first_token: bool = False
    """Set by the LLM worker for a request sampled by the fidelity monitor: the engine returns
    the served pass's first-token distribution in `DoneEvent.first_token`."""

    def serve_by(self, name: str, policy: Policy) -> None:
        """Serve this prompt by `policy`, parsed from `name` (the Resolver's check, the fidelity
        loop's budget): both fields at once."""
        self.policy, self.parsed_policy = name, CarriedPolicy(policy)

    @property
    def entry_ids(self) -> list[str]:
        """Every linked entry id, in prompt order (repeats kept)."""
        return [s.entry_id for t in self.turns for s in t.segments if s.kind == "entry"]


@dataclass
class EncodedImage:
    """Encoder output: the bytes, content hash and input embeddings of one image."""

    media: bytes
    """The image file as uploaded (engines that encode inside `compute_entry` need it)."""
    content_hash: str
    """sha256 hex of the media bytes."""
    media_type: str
    """MIME type detected from the bytes, e.g. image/png."""
    input_embeds: torch.Tensor | None
    """[T, hidden]; None for engines that encode inside `compute_entry` (vLLM)."""
    extra: dict[str, Any] = field(default_factory=dict)


__all__ = [
    "CarriedPolicy",
    "DoneEvent",
    "EncodedImage",
    "LinkedPrompt",
    "LinkedTurn",
    "Sampling",
    "Segment",
    "TokenEvent",
    "TokenLogprob",
]
