"""`mpic bench compress --engine vllm` (CLI process; vLLM's engine core and worker are its child
processes): the presses' uniform-across-layers variant on vLLM, i.e. compressed image and
document entries (`mpic.engine.vllm.presses`), per press and budget against the uncompressed
linked run. It drives `mpic bench offline`'s vLLM engine (`mpic.engine.vllm.async_engine
.AsyncVllmEngine`) through the `Engine` protocol alone, by the measuring code the reference
engine's run uses (`mpic.benchmarks.compress.rows`: `CompressBench` over that benchmark's
`Driver`, `run_compress`): every run is a linked `GenerateRequest` (never `plain`, `full`
included) with a fresh `cache_salt`, decoded by `decoded_ids`; `VllmCompressBench` replaces
only what vLLM measures differently (below).

Prompts: `--prompts` interleaved prompts of `--images` synthetic images, or `--documents`
standard-library passages cached as text documents with a question (`--items documents`, for a
model with a trained language model), their entries computed by vLLM's own forward. Per prompt
the uncompressed run (same policy, full entries) decodes `--steps` greedy tokens with the whole
vocabulary's log-probs (`GenerateRequest.capture_steps`, `capture_top_k=-1`) and is the
reference; every (press, budget) run links the items' compressed entries instead
(`Engine.press_entry`: made by vLLM's worker once per item, press and budget; not timed).
Per (press, budget), means over the prompts, in the columns of
`mpic.benchmarks.compress.bench`:

- `kv_bytes`: bytes of the paged KV vLLM holds for the request while decoding: its blocks,
  ceil((N + steps) / block_size) * block_size slots * L * 2 (K, V) * H_kv * D * dtype bytes
  (N: `Prefill.prompt_tokens`; block size and dtype: the engine's `VllmEngineConfig`);
  `kv_bytes_full` the same for the uncompressed prompt. Only item tokens shrink (text and the
  question are computed per request), so the reduction is the items' share of the prompt times
  (1 - b), rounded to blocks;
- `decode_ms_per_token`: (wall time of a `steps`-token request - that of a 1-token request) /
  (steps - 1), both without log-probs and with a fresh cache salt (no prefix-cache hit), each
  from the request to its last token (planning included in both);
- `kl_mean`: mean KL(p_ref || p) over the decode steps whose context is still the reference's
  (every step up to and including the first differing token): vLLM cannot teacher-force;
- `top1_match`: the first generated token equals the reference's (over the compressed prompt:
  unlike the reference engine, the first token already sees the compressed images);
- `token_agreement`: share of the `--steps` free-running greedy positions equal to the
  reference's.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from mpic.benchmarks.compress.rows import CompressBench
from mpic.benchmarks.offline.bench import kl_divergence
from mpic.benchmarks.offline.engines import get_engine
from mpic.engine.request_flow import pressed_parts

if TYPE_CHECKING:
    from mpic.engine.protocol import Prefill
    from mpic.engine.vllm.async_engine import AsyncVllmEngine
    from mpic.prompt_parts import PromptPart


class VllmCompressBench(CompressBench):
    """`CompressBench` on a vLLM `Engine` (`AsyncVllmEngine`, full-vocabulary log-probs): the
    same requests, with what vLLM measures differently (module docstring): compressed entries
    made before a run, paged KV bytes, decode time by difference, no teacher forcing."""

    warm_up = True

    def __init__(self, model_dir: str | None = None, engine: AsyncVllmEngine | None = None) -> None:
        """A new engine for `model_dir` (`mpic bench offline`'s vLLM engine: entries in a
        temporary store), or `engine` (started with `max_logprobs=-1`)."""
        if engine is None:
            assert model_dir is not None
            engine = cast("AsyncVllmEngine", get_engine("vllm", model_dir))
        super().__init__(engine)
        self.vllm = engine
        # vLLM's paged cache (its configuration): bytes of one token's K and V in every layer
        cfg = engine.cfg
        dtype_bytes = torch.empty((), dtype=getattr(torch, cfg.dtype)).element_size()
        self.token_bytes = (
            self.spec.num_layers * 2 * self.spec.num_kv_heads * self.spec.head_dim * dtype_bytes
        )
        self.block_size = cfg.block_size

    def pressed(self, parts: list[PromptPart], press: str, budget: float) -> list[PromptPart]:
        """`parts` with every image and document replaced by its compressed entry
        (`Engine.press_entry`, made by vLLM's worker on first use)."""
        return pressed_parts(parts, self.entries, lambda e: self.vllm.press_entry(e, press, budget))

    def run(
        self,
        parts: list[PromptPart],
        policy: str,
        steps: int,
        press: str | None = None,
        budget: float | None = None,
        forced: Sequence[int] = (),
    ) -> dict[str, Any]:
        """`CompressBench.run` over `parts` with its items' compressed entries linked when a
        press is named (`pressed`: made before the run, not timed)."""
        if press is not None:
            parts = self.pressed(parts, press, 1.0 if budget is None else budget)
        return super().run(parts, policy, steps, forced=forced)

    def kv_bytes(self, prefill: Prefill, steps: int) -> int:
        """The request's paged KV: ceil((N + steps) / block_size) blocks."""
        blocks = math.ceil((prefill.prompt_tokens + steps) / self.block_size)
        return blocks * self.block_size * self.token_bytes

    def ms_per_token(
        self, stamps: list[float], parts: list[PromptPart], policy: str, steps: int
    ) -> float:
        """(time of a `steps`-token request - time of a 1-token request) / (steps - 1), both
        timed without log-probs (building a vocabulary-sized dict per step would dominate)."""
        t0 = time.perf_counter()
        self.driver.run(self.request(parts, policy, steps))
        t_steps = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.driver.run(self.request(parts, policy, 1))
        t_one = time.perf_counter() - t0
        return 1e3 * max(t_steps - t_one, 0.0) / (steps - 1)

    def pressed_run(
        self,
        ref: dict[str, Any],
        parts: list[PromptPart],
        policy: str,
        steps: int,
        press: str,
        budget: float,
    ) -> tuple[dict[str, Any], float, float]:
        """The press run, its KL over the steps in the reference's context (`_common_kl`: vLLM
        cannot teacher-force) and whether its first token is the reference's."""
        got = self.run(parts, policy, steps, press, budget)
        return got, _common_kl(ref, got), float(ref["tokens"][0] == got["tokens"][0])

    def close(self) -> None:
        """Close the driver's loop and stop vLLM's processes."""
        super().close()
        self.vllm.close()


def _common_kl(ref: dict[str, Any], got: dict[str, Any]) -> float:
    """Mean KL over the steps whose context equals the reference's (up to the first
    differing token, inclusive)."""
    kls = []
    for r_lp, g_lp, r_t, g_t in zip(
        ref["logits"], got["logits"], ref["tokens"], got["tokens"], strict=False
    ):
        kls.append(kl_divergence(r_lp, g_lp))
        if r_t != g_t:
            break
    return statistics.mean(kls)
