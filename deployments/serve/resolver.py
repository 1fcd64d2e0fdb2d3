"""The Resolver deployment (Serve replica): resolves a chat request into a `LinkedPrompt`.

Resolution happens in the CALLER's namespace only: a file id of another user is "not found"
(404, the same answer as an unknown id), an expired one 410. Inline `image_url` parts are
decoded and size-checked here and kept as bytes: the Ingress has them encoded for this request
only (not cached; the Encoder's result travels to the worker as an ObjectRef the Ingress owns,
`mpic.deployments.serve.inline`); MRAG retrieval asks the Retriever deployment and links its hits
(images, and text passages as documents) before the last user turn's text.
The policy is parsed and checked here, once (`mpic.deployments.serve.policy_check`, against the
served model's layer count bound in at build time), and the parsed `Policy` travels in the
prompt (`LinkedPrompt.parsed_policy`, relayed unread by the Ingress) to the worker, which never
parses it again; a chat makes two Ray calls: this resolve, then the worker's generate. The link
plan itself (token ids, positions, policy selection) is built in the LLM worker, next to the KV
it indexes (docs/design.md "Link plan").
"""

from __future__ import annotations

import base64
import binascii
import re

from ray.serve.handle import DeploymentHandle

from mpic.deployments.chat_request import (
    ChatCompletionRequest,
    ChatMessage,
    FilePart,
    ImagePart,
    MPICOptions,
    TextPart,
)
from mpic.deployments.client_errors import raising
from mpic.deployments.config import ServeAppConfig
from mpic.deployments.messages import LinkedPrompt, LinkedTurn, Segment
from mpic.deployments.monitoring.replica_logs import use_serve_logging
from mpic.deployments.serve.files import FileCatalog
from mpic.deployments.serve.policy_check import check_policy
from mpic.errors import InvalidRequestError, PayloadTooLargeError
from mpic.retriever.spec import RetrievalSpec

_DATA_URL = re.compile(r"^data:image/[A-Za-z0-9.+-]+;base64,(?P<b64>.*)$", re.DOTALL)


class Resolver:
    """Turns an OpenAI chat body into resolved turns for the worker."""

    def __init__(
        self,
        config: ServeAppConfig,
        retriever: DeploymentHandle,
        num_layers: int | None = None,
    ) -> None:
        """`num_layers`: the served model's layer count (`policy_check.model_layers`, read by the
        app builder), which per-layer policies are checked against; None: unchecked."""
        use_serve_logging()
        self.cfg = config
        self.files = FileCatalog(config.store)
        self.retriever = raising(retriever)
        self.num_layers = num_layers

    async def resolve(self, user: str, req: ChatCompletionRequest) -> LinkedPrompt:
        """Resolve files, inline images and retrieval; parse and check the policy (once: the
        prompt carries the parsed policy) and the budget."""
        opts = req.mpic
        policy = opts.policy if opts and "policy" in opts.model_fields_set else None
        policy = budgeted_policy(policy, opts.recompute_budget if opts else None, self.cfg)
        named = opts.model_fields_set if opts is not None else set()
        defaulted = not named & {"policy", "recompute_budget"}  # the server's default applies
        parsed = check_policy(policy, self.num_layers)
        press, budget = self._press(opts)
        exact_decode = self._exact_decode(opts, press)
        turns = [await self._turn(user, m) for m in req.messages]
        retrieved: list[str] = []
        if opts is not None and opts.retrieval is not None:
            spec = opts.retrieval
            if spec == "auto":
                spec = RetrievalSpec(collection=await self._auto_collection(), mode="auto")
            retrieved = await self._retrieve(turns, spec)
        max_tokens = req.max_completion_tokens or req.max_tokens
        prompt = LinkedPrompt(
            turns=turns,
            policy=policy,
            retrieved=retrieved,
            max_tokens=max_tokens or self.cfg.engine.max_tokens_default,
            press=press,
            budget=budget,
            exact_decode=exact_decode,
            template=req.template_options(),
            policy_defaulted=defaulted,
        )
        prompt.serve_by(policy, parsed)
        return prompt

    def _press(self, opts: MPICOptions | None) -> tuple[str | None, float | None]:
        """The request's press and budget, else the server's defaults; a press other than at
        budget 1.0 needs an engine that compresses: the reference engine (every press exactly)
        or vLLM (the uniform variant on compressed image entries; its worker refuses M-RoPE
        models with a 400, docs/presses.md)."""
        fields = opts.model_fields_set if opts is not None else set()
        press = opts.press if "press" in fields else self.cfg.default_press
        budget = opts.budget if "budget" in fields else None
        if budget is None:
            budget = self.cfg.default_budget
        if press is None or budget >= 1.0:
            return None, None
        if self.cfg.engine.kind not in ("reference", "vllm"):
            raise InvalidRequestError(
                f"mpic.press: the {self.cfg.engine.kind} engine does not compress KV; serve "
                "with the reference engine (engine.kind: reference) or vLLM (engine.kind: vllm)",
                param="mpic.press",
            )
        return press, budget

    def _exact_decode(self, opts: MPICOptions | None, press: str | None) -> bool:
        """The request's `mpic.exact_decode`, else the server's `default_exact_decode`; 400
        when the request asks for it beside a press (exact decoding reads the items whole,
        which would undo the press)."""
        asked = opts.exact_decode if opts is not None else None
        if asked and press is not None:
            raise InvalidRequestError(
                "mpic.exact_decode decodes over the items' whole exact KV: it cannot be "
                "combined with a KV press (mpic.press / the server's default_press)",
                param="mpic.exact_decode",
            )
        if asked is None:
            return self.cfg.default_exact_decode and press is None
        return asked

    async def _turn(self, user: str, msg: ChatMessage) -> LinkedTurn:
        if isinstance(msg.content, str):
            return LinkedTurn(msg.role, [Segment("text", text=msg.content)])
        segments: list[Segment] = []
        for i, part in enumerate(msg.content):
            if isinstance(part, TextPart):
                segments.append(Segment("text", text=part.text))
            elif isinstance(part, FilePart):
                entry_id, sha, document = self.files.resolve_item(user, part.file.file_id)
                segments.append(
                    Segment(
                        "entry",
                        entry_id=entry_id,
                        content_hash=sha,
                        file_id=part.file.file_id,
                        document=document,
                    )
                )
            elif isinstance(part, ImagePart):
                segments.append(await self._inline(part, i))
        if msg.role != "user" and any(s.kind != "text" for s in segments):
            raise InvalidRequestError(f"images are only allowed in user messages, not {msg.role}")
        return LinkedTurn(msg.role, segments)

    async def _inline(self, part: ImagePart, index: int) -> Segment:
        match = _DATA_URL.match(part.image_url.url)
        if match is None:
            raise InvalidRequestError(
                "image_url must be a data:image/...;base64 URL (remote URLs are not fetched)",
                param=f"content[{index}].image_url.url",
            )
        try:
            data = base64.b64decode(match["b64"], validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidRequestError(f"image_url is not valid base64: {exc}") from exc
        if len(data) > self.cfg.limits.max_upload_bytes:
            raise PayloadTooLargeError("inline image over the upload size limit")
        return Segment("inline", media=data)  # encoded by the Ingress's request (serve.inline)

    async def _auto_collection(self) -> str:
        """The collection of `"retrieval": "auto"`: `default_collection`, else the one an admin
        refreshed last; 400 saying which to set while there is neither."""
        name = self.cfg.default_collection or await self.retriever.last_refreshed.remote()
        if name is None:
            raise InvalidRequestError(
                '"retrieval": "auto" has no collection to search: set default_collection in '
                "the server config, or refresh a collection first (mpic-admin library refresh "
                "SOURCE --collection NAME)",
                param="mpic.retrieval",
            )
        return name

    async def _retrieve(self, turns: list[LinkedTurn], spec: RetrievalSpec) -> list[str]:
        """Search with the last user turn (its text and its images: inline or uploaded, each
        embedded by the collection's CLIP model) and link the hits before that turn."""
        users = [t for t in turns if t.role == "user"]
        if not users:
            raise InvalidRequestError("retrieval needs a user message to search with")
        query = " ".join(s.text for s in users[-1].segments if s.kind == "text").strip()
        images: list[bytes] = []
        hashes: list[str] = []
        for seg in users[-1].segments:
            if seg.kind == "inline":
                images.append(seg.media)
            elif seg.kind == "entry" and not seg.document:
                hashes.append(seg.content_hash)
        hits: list[tuple[str, str, str]] = await self.retriever.search.remote(
            spec, query, images, hashes
        )
        users[-1].segments[:0] = [  # a text passage is linked as a document, an image as one
            Segment("entry", entry_id=e, content_hash=h, document=kind == "document")
            for e, h, kind in hits
        ]
        return [e for e, _, _ in hits]


def budgeted_policy(policy: str | None, budget: float | None, cfg: ServeAppConfig) -> str:
    """The policy a request is served by: `mpic.recompute_budget` means the best selection for
    that budget (`auto-<b>`, with no policy or with `auto`); `auto` alone takes the server's
    `recompute_budget` (else the linker's default budget); no policy: `default_policy`.
    InvalidRequestError (400) for a budget beside another policy."""
    if budget is not None:
        if policy not in (None, "auto"):
            raise InvalidRequestError(
                f"mpic.recompute_budget applies to policy 'auto' (or no policy), not {policy!r}",
                param="mpic.recompute_budget",
            )
        return f"auto-{budget:g}"
    if policy == "auto" and cfg.recompute_budget is not None:
        return f"auto-{cfg.recompute_budget:g}"
    return policy or cfg.default_policy
