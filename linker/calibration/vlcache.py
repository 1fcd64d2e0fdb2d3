"""VLCache dynamic recomputation: calibrate per-layer recompute ratios (VLCache section 4.1,
Eq. 5-9; linker, engine-agnostic; runs in the CLI process, `mpic model calibrate-vlcache`).

Sensitivity in our depth model. A token recomputed at layer i needs its hidden state, so it runs
every layer before i (`LinkPlan.recompute_depth` is a number of LEADING layers), and the paper's
"recompute the first r tokens in layer i only" has no meaning here. We measure, on a proxy set
of prompts whose images were cached in the canonical context and are linked after other text
(the mismatched KV of VLCache section 3.2),

    E(d, r) = mean over prompts of MSE(z_orig, z_{d,r})   (z: last prompt token's logits)

where z_{d,r} recomputes the text and the first floor(r T) tokens of each image through layers
1..d and reuses the rest (`vlcache-` with r_1..r_d = r, r_{d+1..L} = 0), and z_orig recomputes
everything. E(0, r) = E(d, 0) = E0 reuses every image token. Layer i's gain at ratio r is its
marginal effect Delta_i(r) = E(i-1, r) - E(i, r), and its sensitivity (Eq. 5) is

    S_i(r) = E0 - Delta_i(r).

The paper's additivity assumption ("the sensitivity of a given layer depends only on its own
recomputation strategy") then predicts the error of r_1 >= ... >= r_L as
sum_i S_i(r_i) - (L - 1) E0; it is exact for a static ratio (the sum telescopes to E(L, r)).

Search (Eq. 6-9): minimise sum_i S_i(r_i) s.t. sum_i r_i <= P_tar (Eq. 7, a SUM over layers;
`calibrate` takes the average r_bar = P_tar / L, as VLCache's tables report), r non-increasing
(Eq. 8), r_i on the grid (Eq. 9, plus 0: a layer may recompute no image token). Greedy: from
all zeros, each step raises one layer i to a higher grid level g, lifting the shallower layers
that are below g so Eq. 8 holds, and takes the feasible move of largest sensitivity reduction
per unit of budget; it stops when no move reduces the objective or fits the budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mpic.linker.contracts import LayerAdapter
from mpic.linker.kv.dense import DenseLinkedKV
from mpic.linker.kv.linked import LinkedKV
from mpic.linker.pipeline import link_and_prefill
from mpic.linker.policies.base import Policy
from mpic.linker.policies.full import FullPolicy
from mpic.linker.policies.vlcache import VLCachePolicy
from mpic.linker.recipe import with_policy
from mpic.types import CacheEntry, LinkPlan

_EPS = 1e-9

KVFactory = Callable[[LinkPlan], LinkedKV]


@dataclass
class ProxyPrompt:
    """One calibration prompt: a plan from `build_plan` and its entries (`unique_entries`)."""

    plan: LinkPlan
    entries: list[CacheEntry]


@dataclass
class Sensitivity:
    """Measured errors E(d, r) on the proxy set."""

    levels: list[float]
    """[G] ratio levels, ascending, levels[0] == 0."""
    errors: torch.Tensor
    """float64 [L + 1, G]: errors[d, g] = E(d, levels[g]) (row 0 and column 0 are E0)."""

    @property
    def scores(self) -> torch.Tensor:
        """float64 [L, G]: S_i(r) = E0 - (E(i-1, r) - E(i, r)) for layers i = 1..L (Eq. 5)."""
        e0 = self.errors[0, 0]
        return e0 - (self.errors[:-1] - self.errors[1:])


@dataclass
class Calibration:
    """The outcome of `calibrate`."""

    ratios: list[float]
    """[L] r_1 >= ... >= r_L."""
    policy: str
    """The registry name that runs these ratios (`vlcache-r1:r2:...`)."""
    target: float
    """r_bar = P_tar / L."""
    sensitivity: Sensitivity
    proxy: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per policy name (calibrated, static r_bar): proxy-set `mse`, `kl` and `objective`."""


def parse_grid(spec: str) -> list[float]:
    """Ratios from 'start:stop:step' (inclusive) or 'r1,r2,...'; ValueError on bad input."""
    try:
        if ":" in spec:
            start, stop, step = (float(x) for x in spec.split(":"))
            if step <= 0:
                raise ValueError("step must be positive")
            grid = [
                start + k * step for k in range(int(math.floor((stop - start) / step + _EPS)) + 1)
            ]
        else:
            grid = [float(x) for x in spec.split(",") if x.strip()]
    except ValueError as exc:
        raise ValueError(f"bad grid {spec!r} ({exc}); use start:stop:step or r1,r2,...") from exc
    grid = sorted({round(r, 6) for r in grid})
    if not grid or grid[0] <= 0 or grid[-1] > 1:
        raise ValueError(f"grid {spec!r} must hold ratios in (0, 1]")
    return grid


def dense_kv_factory(adapter: LayerAdapter) -> KVFactory:
    """A zeroed `DenseLinkedKV` per prompt (the reference runner's linked KV)."""
    a = adapter

    def make(plan: LinkPlan) -> LinkedKV:
        return DenseLinkedKV(
            a.num_layers, plan.num_tokens, a.num_kv_heads, a.head_dim, a.dtype, a.device
        )

    return make


def prefix_policy(ratio: float, depth: int, num_layers: int) -> VLCachePolicy:
    """`vlcache-` with r_1..r_depth = ratio and 0 below: the z_{d,r} of E(d, r)."""
    return VLCachePolicy([ratio] * depth + [0.0] * (num_layers - depth))


def _logits(adapter: LayerAdapter, proxy: ProxyPrompt, policy: Policy, make_kv: KVFactory):
    planned = with_policy(proxy.plan, proxy.entries, policy, adapter.num_layers)
    out = link_and_prefill(adapter, planned, make_kv(proxy.plan))
    return out.result.logits.double().cpu()


def _counts(proxy: ProxyPrompt, ratio: float) -> tuple[int, ...]:
    """Recomputed tokens per image at `ratio` (the floor of `VLCachePolicy.depths`)."""
    return tuple(int(math.floor(e.num_tokens * ratio + _EPS)) for e in proxy.entries)


def count_passes(proxies: Sequence[ProxyPrompt], levels: Sequence[float], num_layers: int) -> int:
    """Prefill passes `measure_sensitivity` runs (for a progress bar)."""
    distinct = [len({_counts(p, r) for r in levels} - {_counts(p, 0.0)}) for p in proxies]
    return sum(2 + num_layers * n for n in distinct)


def _proxy_errors(
    adapter: LayerAdapter,
    proxy: ProxyPrompt,
    levels: Sequence[float],
    make_kv: KVFactory,
    tick: Callable[[], None],
) -> torch.Tensor:
    """float64 [L + 1, G]: E(d, levels[g]) on one prompt."""
    num_layers = adapter.num_layers
    ref = _logits(adapter, proxy, FullPolicy(), make_kv)
    tick()

    def error(ratio: float, depth: int) -> float:
        z = _logits(adapter, proxy, prefix_policy(ratio, depth, num_layers), make_kv)
        tick()
        return float(((z - ref) ** 2).mean())

    e0 = error(0.0, 0)
    by_counts = {_counts(proxy, 0.0): [e0] * (num_layers + 1)}
    columns = []
    for ratio in levels:
        key = _counts(proxy, ratio)
        if key not in by_counts:
            by_counts[key] = [e0] + [error(ratio, d) for d in range(1, num_layers + 1)]
        columns.append(by_counts[key])
    return torch.tensor(columns, dtype=torch.float64).T


@torch.inference_mode()
def measure_sensitivity(
    adapter: LayerAdapter,
    proxies: Sequence[ProxyPrompt],
    grid: Sequence[float],
    make_kv: KVFactory | None = None,
    advance: Callable[[], None] | None = None,
) -> Sensitivity:
    """E(d, r) for d = 0..L and r in [0] + grid, averaged over `proxies` (module docstring).

    Grid values that recompute the same tokens of every image share one pass per depth.
    `advance` is called after each prefill pass (`count_passes` of them).
    """
    if not proxies:
        raise ValueError("the proxy set is empty")
    make_kv = make_kv or dense_kv_factory(adapter)
    levels = [0.0, *grid]
    tick = advance or (lambda: None)
    errors = sum(_proxy_errors(adapter, p, levels, make_kv, tick) for p in proxies)
    return Sensitivity(levels=levels, errors=errors / len(proxies))


def greedy_ratios(scores: torch.Tensor, levels: Sequence[float], budget: float) -> list[float]:
    """Greedy solution of Eq. 6-9: r_1 >= ... >= r_L on `levels` with sum r_i <= budget.

    scores [L, G]: S_i(levels[g]); levels [G] ascending with levels[0] == 0. Each step raises
    layer i to level g > r_i, lifting layers j < i to max(r_j, g) (Eq. 8), and takes the move
    with the largest reduction of sum_i S_i(r_i) per unit of budget spent (ties: shallower
    layer, then lower level); stops when no feasible move reduces the sum.
    """
    s = torch.as_tensor(scores, dtype=torch.float64)
    lv = torch.as_tensor(list(levels), dtype=torch.float64)
    num_layers, num_levels = s.shape
    assert lv.shape[0] == num_levels and float(lv[0]) == 0.0, "levels start at 0"
    cur = torch.zeros(num_layers, dtype=torch.int64)
    grid = torch.arange(num_levels)
    spent = 0.0
    while True:
        lifted = torch.maximum(cur[:, None], grid[None, :])  # [L, G] level of j if raised to g
        cost = (lv[lifted] - lv[cur][:, None]).cumsum(0)  # raise layers 1..i to g
        gain = (s.gather(1, cur[:, None]) - s.gather(1, lifted)).cumsum(0)
        ok = (grid[None, :] > cur[:, None]) & (spent + cost <= budget + _EPS)
        rate = torch.where(ok, gain / cost.clamp_min(_EPS), -math.inf)
        layer, level = divmod(int(rate.argmax()), num_levels)
        if not float(rate[layer, level]) > 0:
            return [float(lv[c]) for c in cur]
        spent += float(cost[layer, level])
        cur[: layer + 1] = torch.clamp_min(cur[: layer + 1], level)


def objective(scores: torch.Tensor, levels: Sequence[float], ratios: Sequence[float]) -> float:
    """Eq. 6: sum_i S_i(r_i) for ratios on `levels`."""
    index = [min(range(len(levels)), key=lambda g: abs(levels[g] - r)) for r in ratios]
    return float(sum(scores[i, g] for i, g in enumerate(index)))


@torch.inference_mode()
def proxy_fidelity(
    adapter: LayerAdapter,
    proxies: Sequence[ProxyPrompt],
    policy: Policy,
    make_kv: KVFactory | None = None,
) -> dict[str, float]:
    """Mean logit MSE and KL(full || policy) of the last prompt token over the proxy set."""
    make_kv = make_kv or dense_kv_factory(adapter)
    mse = kl = 0.0
    for proxy in proxies:
        ref = _logits(adapter, proxy, FullPolicy(), make_kv)
        z = _logits(adapter, proxy, policy, make_kv)
        mse += float(((z - ref) ** 2).mean())
        p, q = torch.log_softmax(ref, -1), torch.log_softmax(z, -1)
        kl += max(0.0, float((p.exp() * (p - q)).sum()))
    return {"mse": mse / len(proxies), "kl": kl / len(proxies)}


def calibrate(
    adapter: LayerAdapter,
    proxies: Sequence[ProxyPrompt],
    target: float,
    grid: Sequence[float],
    make_kv: KVFactory | None = None,
    advance: Callable[[], None] | None = None,
) -> Calibration:
    """Measure S_i(r) on `proxies`, run the greedy with P_tar = target * L, and score the result
    and the static ratio r_bar (the largest grid level <= target) on the proxy set."""
    if not 0 < target <= max(grid):
        raise ValueError(f"target {target} must lie in (0, {max(grid)}] (the grid's range)")
    num_layers = adapter.num_layers
    sens = measure_sensitivity(adapter, proxies, grid, make_kv, advance)
    scores = sens.scores
    ratios = greedy_ratios(scores, sens.levels, target * num_layers)
    static = max(r for r in sens.levels if r <= target + _EPS)
    cal = Calibration(ratios, VLCachePolicy(ratios).name, target, sens)
    for rs in (ratios, [static] * num_layers):
        policy = VLCachePolicy(rs)
        scored = proxy_fidelity(adapter, proxies, policy, make_kv)
        cal.proxy[policy.name] = {**scored, "objective": objective(scores, sens.levels, rs)}
    return cal


def calibrate_with_progress(
    adapter: LayerAdapter,
    proxies: Sequence[ProxyPrompt],
    target: float,
    grid: Sequence[float],
    progress: Any,
) -> Calibration:
    """`calibrate` with its sensitivity passes counted on `progress` (a `rich.progress.Progress`:
    `add_task`, `advance`), for the commands that run it."""
    total = count_passes(proxies, [0.0, *grid], adapter.num_layers)
    task = progress.add_task("VLCache sensitivity passes", total=total)
    return calibrate(adapter, proxies, target, grid, advance=lambda: progress.advance(task))
