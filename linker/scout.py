"""The scouting pass of query-aware selection (linker; the named scout stage of the one link
pass, `mpic.linker.pipeline.link_pass`, between linking and the selective pass; reference runner
and vLLM worker).

ProphetKV-style relevance to the user query, in one cheap pass: the prompt's text tokens (the
tokens the plan recomputes anyway: instructions, headers, the question; not the cached template
prefix, whose exact KV is already linked: `ScoutTask.skip`) run through the first
`max(layers) + 1` decoder layers over the linked item KV (cached, rotated; exactly the state the
selective prefill starts from). At each scoring layer l the attention probabilities of the
scoring rows r (the text after the last item: the question, then the chat template's assistant
header, whose LAST row is the one that produces the first output token) over every visible key
are computed from the same q and keys, and every item token j gets

    score_j = sum_{l in layers} mean_h [ p_{l,h}(last row, j)
                                         + w_q * mean_{r in question rows} p_{l,h}(r, j) ]

(w_q = `question_weight`; 0 by default: on SmolLM2 the last row alone scored best at 20-30%
recomputed, and then only that row's attention is computed). The item keys are the ones just
linked (`mpic.linker.link.linked_items`: rotated once to this prompt's positions, for the linked
KV and the scout alike), the text keys come from the pass itself, so nothing is read back from
the linked KV (the paged CPU cache is opaque). The text K/V the scout writes
are overwritten by the selective prefill, which recomputes text at every layer; item slots are
not touched.

Batched (`scout_pass`): the scouting requests of a batch (`ScoutTask`, one per request) run in
ONE pass: their text tokens stacked (request r's prompt index p at `offset_r + p` of a stacked
linked KV, `mpic.linker.kv.stacked`) go through each layer's projections, attention and MLP
together; nothing in the layer loop mixes requests (each row attends over its own request's
keys), and each request's scores are computed from its own rows of q and k and its own item
keys, exactly as alone. A request whose scoring layers end earlier leaves the pass there.

Cost: `tokens` queries x `layers_run` layers (reported in `ScoutReport`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from mpic.linker.contracts import LayerAdapter
from mpic.linker.kv.linked import LinkedKV
from mpic.linker.link import LinkedItems, cat_parts, gather_input_embeds
from mpic.types import CacheEntry, LinkPlan


@dataclass(frozen=True)
class ScoutReport:
    """What the scouting pass cost."""

    layers_run: int
    """Leading decoder layers the scout tokens ran through."""
    tokens: int
    """Tokens that ran (the plan's recomputed text)."""
    scoring_layers: tuple[int, ...]
    """Layers whose attention was scored."""
    requests: int = 1
    """Scouting requests whose tokens ran in this same pass (`scout_pass`; 0: none ran)."""


@dataclass
class ScoutTask:
    """One request's share of a scouting pass (`scout_pass`; `Policy.scout_task` makes it)."""

    plan: LinkPlan
    """The pre-scout plan (depth L for the tokens the scout runs: text and the last token)."""
    entries: Sequence[CacheEntry]
    items: LinkedItems | None
    """Every item token's linked K/V (`linked_items(..., every_item=True)`; None: no item)."""
    layers: Sequence[int]
    """The scoring layers."""
    question_weight: float = 0.0
    offset: int = 0
    """The request's first index in the linked KV the pass runs over (0: its own)."""
    skip: int = 0
    """Leading prompt tokens the scout does not run: the cached prefix, whose exact K/V the link
    wrote at every layer (`mpic.linker.prefix`); its text rows attend to them there."""


def scoring_rows(plan: LinkPlan, index: torch.Tensor) -> torch.Tensor:
    """int64 rows of `index` (the scout tokens) after the plan's last item token: the question
    and the template tail (always contains the last prompt token)."""
    items = torch.nonzero(~plan.is_text).flatten()
    last_item = int(items[-1]) if items.numel() else -1
    return torch.nonzero(index.cpu() > last_item).flatten()


def scout_scores(
    adapter: LayerAdapter,
    plan: LinkPlan,
    entries: Sequence[CacheEntry],
    linked_kv: LinkedKV,
    layers: Sequence[int],
    items: LinkedItems | None,
    question_weight: float = 0.0,
) -> tuple[torch.Tensor, ScoutReport]:
    """Scores float32 [N] (0 for text) of every item token, and the scout's cost: the scouting
    pass of one request (`scout_pass` of one task).

    plan: the pre-scout plan (depth L for the tokens the scout runs: text and the last token);
    linked_kv: already linked (`link_entries`) with every item token's cached KV; items: that
    K/V (`mpic.linker.link.linked_items(..., every_item=True)`; None: the plan has no item).
    """
    task = ScoutTask(plan, entries, items, layers, question_weight)
    return scout_pass(adapter, [task], linked_kv)[0]


@dataclass(eq=False)
class _Run:
    """A task's state inside the pass."""

    scoring: list[int]
    run_to: int
    index: torch.Tensor
    """int64 [S] (host): the request's scout tokens (prompt indices)."""
    idx: torch.Tensor
    """The same on the device."""
    rows: torch.Tensor
    """Device rows of `idx` whose attention is scored."""
    weights: torch.Tensor
    item_idx: torch.Tensor
    item_dev: torch.Tensor
    item_k: torch.Tensor
    hidden: torch.Tensor
    pos: torch.Tensor
    offset: int
    num_tokens: int
    total: torch.Tensor
    seen: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """Per scoring layer reached: (q of the scored rows [R, H, D], k of the tokens [S, H_kv, D])."""


def scout_pass(
    adapter: LayerAdapter, tasks: Sequence[ScoutTask], linked_kv: LinkedKV
) -> list[tuple[torch.Tensor, ScoutReport]]:
    """Scores float32 [N_r] and the cost of every task's scout, all tasks in one pass over the
    layers (module docstring). linked_kv: the tasks' requests' linked KV, every item linked;
    task r's prompt index p is its index `offset_r + p` (one task at offset 0: its own KV)."""
    num_layers = adapter.num_layers
    dev = adapter.device
    out: list[tuple[torch.Tensor, ScoutReport] | None] = []
    runs: list[_Run] = []
    for task in tasks:
        scoring = sorted({min(max(int(x), 0), num_layers - 1) for x in task.layers})
        plan, items = task.plan, task.items
        index = torch.nonzero(plan.recompute_depth >= num_layers).flatten()
        index = index[index >= task.skip] if task.skip else index
        if task.question_weight == 0.0:  # the last prompt row only, where it follows every item
            last = index.numel() > 0 and bool(plan.is_text[-1])
            rows = torch.tensor([index.numel() - 1]) if last else index[:0]
        else:
            rows = scoring_rows(plan, index)
        if index.numel() == 0 or rows.numel() == 0 or items is None:
            scores = torch.zeros(plan.num_tokens, dtype=torch.float32)
            out.append((scores, ScoutReport(0, 0, tuple(scoring), requests=0)))
            continue
        item_idx = items.slots
        if rows.numel() == 1:
            weights = torch.ones(1)  # the last prompt row
        else:
            weights = torch.full((rows.numel(),), task.question_weight / (rows.numel() - 1))
            weights[-1] = 1.0  # the last prompt row
        runs.append(
            _Run(
                scoring=scoring,
                run_to=scoring[-1] + 1,
                index=index,
                idx=index.to(dev),
                rows=rows.to(dev),
                weights=weights.to(dev),
                item_idx=item_idx,
                item_dev=item_idx.to(dev),
                item_k=items.keys[torch.as_tensor(scoring, device=items.keys.device)].to(dev),
                hidden=gather_input_embeds(adapter, plan, task.entries, index),
                pos=plan.positions[..., index].to(dev),
                offset=task.offset,
                num_tokens=plan.num_tokens,
                total=torch.zeros(item_idx.numel(), dtype=torch.float32, device=dev),
            )
        )
        out.append(None)
    if runs:
        _layers(adapter, runs, linked_kv)
    ran = iter(runs)
    results = []
    for got in out:
        if got is None:
            run = next(ran)
            scores = torch.zeros(run.num_tokens, dtype=torch.float32)
            scores[run.item_idx] = run.total.cpu()
            report = ScoutReport(run.run_to, int(run.index.numel()), tuple(run.scoring), len(runs))
            got = (scores, report)
        results.append(got)
    return results


def _layers(adapter: LayerAdapter, runs: list[_Run], linked_kv: LinkedKV) -> None:
    """The runs' tokens, stacked, through their layers; each run's scored rows' q and its tokens'
    k kept at its scoring layers, and its scores computed for all of them at once after its last
    (`_score`)."""
    active: list[_Run] = []
    hidden = pos = gidx = torch.empty(0)
    bounds: list[tuple[int, int]] = []
    scored: dict[_Run, tuple[int, int, torch.Tensor]] = {}  # run -> (a, b, its scored rows)
    for layer in range(max(run.run_to for run in runs)):
        now = [run for run in runs if run.run_to > layer]
        if now != active:  # the first layer, or a run's scoring layers ended
            if active:  # keep the rows of the runs that go on
                keep = [
                    torch.arange(a, b)
                    for run, (a, b) in zip(active, bounds, strict=True)
                    if run in now
                ]
                take = torch.cat(keep).to(adapter.device)
                hidden, pos, gidx = hidden[take], pos[..., take], gidx[take]
            else:
                hidden = cat_parts([run.hidden for run in now])
                pos = cat_parts([run.pos for run in now], dim=-1)
                gidx = cat_parts([run.idx + run.offset if run.offset else run.idx for run in now])
            active = now
            sizes = [int(run.index.numel()) for run in active]
            ends = list(accumulate(sizes))
            bounds = [(end - size, end) for size, end in zip(sizes, ends, strict=True)]
            scored = {
                r: (a, b, r.rows + a if a else r.rows)
                for r, (a, b) in zip(active, bounds, strict=True)
            }
        q, k, v = adapter.attention_inputs(layer, hidden, pos)
        linked_kv.write(layer, gidx, k, v)
        for run in active:
            if layer in run.scoring:
                a, b, rows = scored[run]
                run.seen.append((q[rows], k[a:b]))
                if len(run.seen) == len(run.scoring):
                    _score(adapter, run)
        if layer + 1 < max(run.run_to for run in active):
            attn = linked_kv.attend(layer, q, gidx)
            hidden = adapter.attention_output_and_mlp(layer, hidden, attn)


def _score(adapter: LayerAdapter, run: _Run) -> None:
    """The run's scores (`run.total`, every item token) from the q and k it kept at each of its
    Ls scoring layers, all layers in ONE batch of ops (not one batch per layer): keys float32
    [Ls, N, H_kv, D] (the item tokens' linked keys, the scout tokens' own), logits of the R
    scored rows [Ls, H_kv, group * R, N] with query head h reading key head h // group (no
    repeated keys), then the equation of the module docstring."""
    dev = adapter.device
    n_kv, head_dim = adapter.num_kv_heads, adapter.head_dim
    group = adapter.num_heads // n_kv
    layers, n = len(run.seen), run.num_tokens
    qr = torch.stack([q for q, _ in run.seen]).float()  # [Ls, R, H, D]
    rows = qr.shape[1]
    keys = torch.zeros((layers, n, n_kv, head_dim), dtype=torch.float32, device=dev)
    keys[:, run.item_dev] = run.item_k.float()
    keys[:, run.idx] = torch.stack([k for _, k in run.seen]).float()
    # [Ls, R, H_kv, group, D] -> [Ls, H_kv, group * R, D]: head h = kv * group + g
    qg = qr.view(layers, rows, n_kv, group, head_dim).permute(0, 2, 3, 1, 4)
    logits = torch.matmul(
        qg.reshape(layers, n_kv, group * rows, head_dim), keys.permute(0, 2, 3, 1)
    )
    logits = logits.view(layers, n_kv * group, rows, n) * head_dim**-0.5  # [Ls, H, R, N]
    visible = torch.arange(n, device=dev)[None, :] <= run.idx[run.rows][:, None]  # [R, N]
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    per_key = (probs.mean(dim=1) * run.weights[:, None]).sum(dim=1)  # [Ls, N]
    run.total += per_key[:, run.item_dev].sum(dim=0)
