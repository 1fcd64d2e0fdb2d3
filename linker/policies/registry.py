"""Policy registry: `get_policy("mpic-32")` (linker; CLI and Serve replica parse user names).

Names: `full`, `prefix`, `full-reuse`, `cacheblend-<r>` (r in percent), `mpic-<k>`, `boundary-<k>`,
`vlcache-<r>` (static ratio) or `vlcache-<r1>:<r2>:...` (per-layer, non-increasing),
`scout-<b>[:s<S>[/<S>]][:i<S>][:k<K>][:d<tau>][:l<a>-<b>][:w<w>]` (query-aware selection at
budget fraction b with the linked-key correction S, S for mostly-image prompts, K boundary tokens
per item, tau of the offset prior, the scout's scoring layers a..b and question weight w:
`ScoutPolicy`),
`auto` / `auto-<b>`: the best selection the benchmark found for a budget (today `scout-<b>`;
`auto` takes the request's or the server's budget, `DEFAULT_BUDGET` otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence

from mpic.linker.policies.base import Policy
from mpic.linker.policies.boundary import BoundaryPolicy
from mpic.linker.policies.cacheblend import CacheBlendPolicy
from mpic.linker.policies.full import FullPolicy
from mpic.linker.policies.full_reuse import FullReusePolicy
from mpic.linker.policies.mpic import MPICPolicy
from mpic.linker.policies.prefix import PrefixPolicy
from mpic.linker.policies.scout import ScoutPolicy
from mpic.linker.policies.scout_scales import table_scales
from mpic.linker.policies.vlcache import VLCachePolicy

POLICY_NAMES = (
    "full",
    "prefix",
    "full-reuse",
    "cacheblend-<r>",
    "mpic-<k>",
    "boundary-<k>",
    "vlcache-<r>[:<r>...]",
    "scout-<b>[:s<S>][:i<S>][:k<K>][:d<tau>][:l<a>-<b>][:w<w>]",
    "auto",
    "auto-<b>",
)
"""The name patterns `get_policy` accepts."""

DEFAULT_BUDGET = 0.18
"""The recompute budget (fraction of prompt tokens) `auto` uses when none is given: chosen from
`mpic bench fidelity` with the template prefix linked (docs/fidelity.md: on SmolLM2 with 8
documents KL 0.093, effect kept 92%, and a time to first token below mpic-32's; at 0.2 it was
4-6% above it once the prefix no longer counted against mpic-32). With the scout's offset prior
(2026-11-27) KL 0.078, effect kept 93%; the needle task at 8 documents needs `:k8`
(`scout-0.2:s0.9/0.8:k8`, not the default: docs/fidelity.md "Why the default lost the
needle")."""

_FIXED = {"full": FullPolicy, "prefix": PrefixPolicy, "full-reuse": FullReusePolicy}


def best_for_budget(budget: float, scales: Sequence[Sequence[float]] | None = None) -> Policy:
    """The best selection measured for a budget fraction (docs/fidelity.md): `scout-<b>` with
    its calibrated correction (S from `scales`, a model's table of (budget, S) or (budget, S of
    the first half, S of the second half) rows, else the default tables) and the table's scout
    layers and question weight where it has them (`scout_scales.ScoutTable`)."""
    if scales is None:
        return ScoutPolicy(budget)
    early, late = table_scales(scales, budget)
    return ScoutPolicy(
        budget,
        early,
        late_scale=late,
        layers=getattr(scales, "layers", None),
        question_weight=getattr(scales, "question_weight", None),
    )


def get_policy(
    name: str, budget: float | None = None, scales: Sequence[Sequence[float]] | None = None
) -> Policy:
    """The policy called `name`; ValueError listing the valid names otherwise. `budget` (a
    fraction of prompt tokens) is what `auto` means (default `DEFAULT_BUDGET`); `scales` is a
    model's own (budget, S) table for `scout-<b>` / `auto` names that do not spell S out
    (`mpic model calibrate-scout`)."""
    name = name.strip()
    try:
        if name in _FIXED:
            return _FIXED[name]()
        if name == "auto":
            return best_for_budget(DEFAULT_BUDGET if budget is None else budget, scales)
        family, _, arg = name.partition("-") if name.startswith("scout-") else name.rpartition("-")
        if family == "scout":
            return ScoutPolicy.from_arg(arg, scales)
        if family == "auto":
            return best_for_budget(float(arg), scales)
        if family == "mpic":
            return MPICPolicy(int(arg))
        if family == "boundary":
            return BoundaryPolicy(int(arg))
        if family == "cacheblend":
            return CacheBlendPolicy(float(arg))
        if family == "vlcache":
            return VLCachePolicy([float(r) for r in arg.split(":")])
    except ValueError as exc:
        raise ValueError(f"bad policy {name!r}: {exc}; valid: {', '.join(POLICY_NAMES)}") from exc
    raise ValueError(f"unknown policy {name!r}; valid: {', '.join(POLICY_NAMES)}")


def check_depth(policy: Policy, num_layers: int) -> None:
    """ValueError when a policy's per-layer fields do not fit a model of `num_layers` layers:
    more `vlcache-<r>:...` ratios than layers, or a `scout-<b>:l<a>-<b>` scoring layer past
    them (the one check the Serve Resolver and the CLIs share)."""
    for per_layer in ("layer_ratios", "scoring_layers"):
        check = getattr(policy, per_layer, None)
        if check is not None:
            check(num_layers)


def policy_names(csv: str, num_layers: int | None = None) -> list[str]:
    """Canonical names of a comma-separated list of policies (CLI `--policies`); ValueError as
    `get_policy` for a bad one, or (`num_layers` given) as `check_depth`."""
    policies = [get_policy(p) for p in csv.split(",") if p.strip()]
    if num_layers is not None:
        for policy in policies:
            check_depth(policy, num_layers)
    return [p.name for p in policies]
