"""`sdpa_runs` attention backend: one SDPA call per contiguous run of recomputed queries (kernels;
the test oracle of every other backend and the CPU default).

The recomputed tokens form a few contiguous runs (text, the first k tokens of an item;
docs/design.md "Exact masks"): a run at prompt indices [a, b) sees keys [0, a) fully and itself
causally, so each run is one SDPA call over keys [0, b) with a mask of its own size only
([b - a, b]; none for a single query, `is_causal` for a run starting at 0). Work per head is at
most S x N, and no N x N mask is built when S << N. `prepare` reads the indices on the host once
per query set and builds the masks on the device; `attend` then only launches SDPA calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mpic.kernels.attention_backend import AttentionBackend


def query_runs(q_index: torch.Tensor) -> list[tuple[int, int]]:
    """Split ascending prompt indices into maximal contiguous runs: [(row_start, row_end)]."""
    q_index = q_index.cpu()
    if q_index.numel() == 0:
        return []
    breaks = torch.nonzero(q_index[1:] != q_index[:-1] + 1).flatten() + 1
    edges = [0, *breaks.tolist(), int(q_index.shape[0])]
    return list(zip(edges[:-1], edges[1:], strict=False))


@dataclass
class _Run:
    rows: tuple[int, int]
    """Query rows [r0, r1)."""
    keys: int
    """b: the run sees keys [0, b)."""
    mask: torch.Tensor | None
    """bool [r1 - r0, b] (key j visible to the query at a + i iff j <= a + i), or None."""
    causal: bool


class SdpaRunsBackend(AttentionBackend):
    """Per-run SDPA (see the module docstring)."""

    name = "sdpa_runs"

    def prepare(self, q_index: torch.Tensor, num_keys: int) -> list[_Run]:
        """The runs of `q_index` with their masks (on q_index's device)."""
        host = q_index.cpu()
        runs = []
        for r0, r1 in query_runs(host):
            a, b = int(host[r0]), int(host[r1 - 1]) + 1
            causal = a == 0 and r1 - r0 > 1  # [0, b): a plain causal prefill
            mask = None
            if r1 - r0 > 1 and not causal:
                dev = q_index.device
                mask = (
                    torch.arange(b, device=dev)[None, :] <= torch.arange(a, b, device=dev)[:, None]
                )
            runs.append(_Run((r0, r1), b, mask, causal))
        return runs

    def attend(
        self,
        state: list[_Run],
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        scale: float | None = None,
    ) -> torch.Tensor:
        """One SDPA call per run -> [S, H, D]."""
        gqa = q.shape[1] != keys.shape[1]
        outs = []
        for run in state:
            r0, r1 = run.rows
            k = keys[: run.keys].transpose(0, 1)[None]  # [1, H_kv, b, D]
            v = values[: run.keys].transpose(0, 1)[None]
            qh = q[r0:r1].transpose(0, 1)[None]  # [1, H, run, D]
            out = F.scaled_dot_product_attention(
                qh, k, v, attn_mask=run.mask, is_causal=run.causal, scale=scale, enable_gqa=gqa
            )
            outs.append(out[0].transpose(0, 1))
        return torch.cat(outs) if len(outs) > 1 else outs[0]
