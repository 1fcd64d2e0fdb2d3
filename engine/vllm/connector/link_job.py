"""What the MPIC connector's scheduler half ships to its worker half each step (vLLM engine core
-> vLLM worker, pickled inside vLLM's `SchedulerOutput`).

`LinkJob` is one linked request to materialise: its prompt, its KV blocks, its decoded MPIC
parameters (policy, entries, the run-length-coded plan of `mpic.engine.vllm.params`) and how it
is loaded. The policy travels to vLLM's processes as its canonical name (`kv_transfer_params`
are msgpack), and is parsed once where the job is built, in the scheduler half (`from_request`):
the job carries the parsed `Policy`, pickled with it to the worker half, and the scheduler's
choices (`needs_last_token`, `links_in_its_forward_step`) and the worker's link read that object.
Loads:

- `load_async` (the default for linked requests): the worker half reads the job's entries from
  the tiered store in the background (`mpic.engine.vllm.connector.worker`) while vLLM keeps
  stepping the requests already running; the request waits in vLLM's `WAITING_FOR_REMOTE_KVS`
  state and is linked in the first step after its entries are in memory, then reported finished
  receiving, so vLLM schedules its last prompt token over the linked blocks.
  How much of the work leaves the steps is the load mode (`load_mode`, from
  `kv_connector_extra_config["async_loads"]`): `reads` (the default) reads in the background and
  links in a step; `background` reads AND links in the background (the link on the worker's own
  linking thread, concurrent with vLLM's forwards; experimental: docs/vllm.md); `step` claims
  synchronously.
- `phase2` (two-phase claims, every policy loads its entries in the background first): `link`
  when the request must be linked in the step that runs its last prompt token (its last token
  has no block yet under a policy whose pass reads it, `needs_last_token`; or any non-plain
  policy in `reads` mode): the worker reads and holds the entries, reports them received, and
  the scheduler half ships the job again, synchronous, when vLLM schedules that token.
  `shift` for corrected policies linked in the background: their keys are shifted for vLLM's
  forward of the last token in the step that schedules it (`MPICConnectorMetadata.shift`).
- synchronous: linked in the step that schedules it (reads included), before that step's forward
  (compression requests, load mode `step`).

`MPICConnectorMetadata` carries a step's jobs and its new upload requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from mpic.engine.vllm import params as vllm_params
from mpic.engine.vllm import presses as vllm_presses
from mpic.linker.policies import get_policy
from mpic.linker.policies.base import Policy
from mpic.types import LinkPlan


@dataclass(frozen=True)
class PressSpec:
    """A compression request: the item's canonical prefill is observed, its compressed entry
    stored (`mpic.engine.vllm.presses`)."""

    press: str
    budget: float


@dataclass
class LinkJob:
    """One linked request whose KV the worker half writes into its blocks."""

    req_id: str
    token_ids: list[int]
    """The prompt token ids (N)."""
    block_ids: list[int]
    """All the request's KV blocks, in order (block b holds positions [b*bs, (b+1)*bs))."""
    policy_name: str
    """The policy's canonical name, as the request carries it (`kv_transfer_params`)."""
    policy: Policy | None
    """The policy (its depths are already in the plan), parsed once from `policy_name` where the
    job was built (`from_request`); None: the name does not parse (the worker fails the job,
    `rule`)."""
    entry_ids: tuple[str, ...]
    """Entries the plan links, in plan order (duplicates possible)."""
    plan_body: dict[str, Any]
    """The encoded plan (`kv_transfer_params["mpic"]`), decoded by `plan()` in the worker."""
    press: PressSpec | None = None
    load_async: bool = False
    phase2: str = ""
    """"" (linked once, where its entries are), "link" (entries read ahead, linked in the
    step of its last token) or "shift" (keys shifted in the step of its last token)."""

    @classmethod
    def from_request(
        cls,
        req_id: str,
        token_ids: list[int],
        block_ids: list[int],
        params: dict[str, Any],
        policy: Policy | None = None,
    ) -> LinkJob:
        """The job of a request with MPIC `kv_transfer_params` (`vllm_params.is_linked`), its
        policy parsed from the name they carry (`parse_policy`), unless `policy` gives the one
        an earlier job of the same request parsed (a two-phase claim's second phase)."""
        body = params[vllm_params.KEY]
        press = params.get(vllm_presses.KEY)
        name = str(body.get("policy", ""))
        return cls(
            req_id=req_id,
            token_ids=list(token_ids),
            block_ids=list(block_ids),
            policy_name=name,
            policy=policy if policy is not None else parse_policy(name),
            entry_ids=tuple(body.get("entry_ids", ())),
            plan_body=body,
            press=PressSpec(str(press["press"]), float(press["budget"])) if press else None,
        )

    def rule(self) -> Policy:
        """The job's policy; for a name that did not parse, the parse's ValueError (raised
        again by parsing it: a request no MPIC front end sends, whose link then fails)."""
        if self.policy is None:
            return get_policy(self.policy_name)  # raises: `parse_policy` could not parse it
        return self.policy

    def plan(self) -> LinkPlan:
        """The link plan (InvalidRequestError when malformed or not the prompt's length)."""
        plan, _ = vllm_params.plan_from_params({vllm_params.KEY: self.plan_body}, self.token_ids)
        return plan

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class MPICConnectorMetadata(KVConnectorMetadata):
    """Per-step connector metadata (scheduler half -> worker half)."""

    jobs: list[LinkJob] = field(default_factory=list)
    """Linked requests to link in this step (synchronous) or to start loading (async)."""
    uploads: dict[str, dict[str, Any]] = field(default_factory=dict)
    """New upload requests: req_id -> their `kv_transfer_params` (`mpic.engine.vllm.upload`)."""
    finished: set[str] = field(default_factory=set)
    """Requests that ended while their async job was with the worker: it drops them and
    reports them finished sending (vLLM then frees their blocks)."""
    shift: set[str] = field(default_factory=set)
    """Requests (`phase2 == "shift"`) whose last prompt token this step's forward runs: their
    linked keys are shifted for it (`PagedLinkedKV.shift_for_last_query`), then restored."""
    forget: set[str] = field(default_factory=set)
    """Requests that ended between their two phases: the worker forgets what it holds."""


def batchable(policy: Policy) -> bool:
    """True when a policy's selective pass is the plain one (no text-first pass, no in-pass
    hook, no scouting, no linked-key correction): its requests can share one batched pass, and
    the last prompt token may be left to vLLM's own forward."""
    if policy.two_step or getattr(policy, "scouts", False):
        return False
    return type(policy).layer_hook is Policy.layer_hook and (
        type(policy).correction is Policy.correction if hasattr(Policy, "correction") else True
    )


def parse_policy(name: str) -> Policy | None:
    """The policy a linked request names (its canonical name, `VllmFrontEnd.policy_name`),
    parsed once per job; None for a name that does not parse (the job fails in the worker)."""
    try:
        return get_policy(name)
    except Exception:  # noqa: BLE001 - an unknown name fails later, in the worker, as before
        return None


def links_in_its_forward_step(policy: Policy | None) -> bool:
    """True for policies with a linked-key correction (`scout-*`): the worker shifts the linked
    keys so that vLLM's plain attention of the last prompt token equals the corrected one and
    restores them after that forward (`PagedLinkedKV.shift_for_last_query`), so the request must
    be linked in the step that runs that forward: a synchronous claim. None (a name that did not
    parse, `LinkJob.policy`): False."""
    return policy is not None and bool(policy.corrects)


def needs_last_token(policy: Policy | None) -> bool:
    """True when the policy's pass must include the last prompt token (its selection reads it),
    so the request cannot be linked before that token has a block. None (a name that did not
    parse): True."""
    return policy is None or not batchable(policy)


LOAD_MODES = ("background", "reads", "step")


def load_mode(value: object) -> str:
    """`kv_connector_extra_config["async_loads"]` -> a load mode: true -> "background" (reads
    and linking off the step; experimental), "reads" (the default of `VllmEngineConfig`: reads
    off the step, linking in it), false -> "step" (every claim synchronous)."""
    if value is True or value is None:
        return "background"
    if value is False:
        return "step"
    if value in LOAD_MODES:
        return str(value)
    raise ValueError(f"async_loads must be true, false or one of {LOAD_MODES}, not {value!r}")
