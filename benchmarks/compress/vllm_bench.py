"""`mpic bench compress --engine vllm` (CLI process; vLLM's engine core and worker are its child
processes): the presses' uniform-across-layers variant on vLLM, i.e. compressed image and
document entries (`mpic.engine.vllm.presses`), per press and budget against the uncompressed
linked run. It drives `mpic bench offline`'s vLLM engine (`mpic.engine.vllm.async_engine
.AsyncVllmEngine`) through the `Engine` protocol alone, by that benchmark's `Driver`
(`mpic.benchmarks.offline.engines`): every run is a linked `GenerateRequest` (never `plain`,
`full` included) with a fresh `cache_salt`, decoded by `decoded_ids`.

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
import uuid
from typing import TYPE_CHECKING, Any, cast

import torch

from mpic.benchmarks.compress.rows import baseline_row, press_row
from mpic.benchmarks.offline.bench import kl_divergence
from mpic.benchmarks.offline.engines import Driver, first_token_logits, get_engine
from mpic.engine.request_flow import pressed_parts
from mpic.samples import interleaved_prompt, synthetic_png

if TYPE_CHECKING:
    from mpic.engine.first_token import FirstToken
    from mpic.engine.protocol import GenerateRequest
    from mpic.engine.vllm.async_engine import AsyncVllmEngine
    from mpic.prompt_parts import PromptPart


class VllmCompressBench:
    """The benchmark's requests to a vLLM `Engine` (`AsyncVllmEngine`, full-vocabulary
    log-probs) through the offline benchmark's `Driver`, with the entries it cached."""

    def __init__(self, model_dir: str | None = None, engine: AsyncVllmEngine | None = None) -> None:
        """A new engine for `model_dir` (`mpic bench offline`'s vLLM engine: entries in a
        temporary store), or `engine` (started with `max_logprobs=-1`)."""
        if engine is None:
            assert model_dir is not None
            engine = cast("AsyncVllmEngine", get_engine("vllm", model_dir))
        self.engine = engine
        self.spec = engine.spec
        self.driver = Driver(engine)
        self.entries = self.driver.entries
        # vLLM's paged cache (its configuration): bytes of one token's K and V in every layer
        cfg = engine.cfg
        dtype_bytes = torch.empty((), dtype=getattr(torch, cfg.dtype)).element_size()
        self.token_bytes = (
            self.spec.num_layers * 2 * self.spec.num_kv_heads * self.spec.head_dim * dtype_bytes
        )
        self.block_size = cfg.block_size

    def prompts(self, count: int, per_prompt: int, items: str = "images") -> list[list[PromptPart]]:
        """`count` prompts of `per_prompt` synthetic images, or standard-library passages cached
        as text documents with a question (`items="documents"`, as the reference benchmark's),
        their entries computed by vLLM."""
        if items == "documents":
            from mpic.benchmarks.fidelity.prompts import passages, question_parts

            docs = passages(per_prompt * count)
            out = []
            for p in range(count):
                mine = docs[p * per_prompt : (p + 1) * per_prompt]
                ids = [self.driver.cache_document(d.text) for d in mine]
                out.append(question_parts(mine, ids, p))
            return out
        return [
            interleaved_prompt(
                [self.driver.cache_image(synthetic_png(100 * p + i)) for i in range(per_prompt)]
            )
            for p in range(count)
        ]

    def pressed(self, parts: list[PromptPart], press: str, budget: float) -> list[PromptPart]:
        """`parts` with every image and document replaced by its compressed entry
        (`Engine.press_entry`, made by vLLM's worker on first use)."""
        return pressed_parts(
            parts, self.entries, lambda e: self.engine.press_entry(e, press, budget)
        )

    def _request(
        self, parts: list[PromptPart], policy: str, steps: int, **options: Any
    ) -> GenerateRequest:
        """The greedy linked request of `steps` tokens (`full` too: never plain), salted: no
        prefix-cache hit between runs."""
        salt = f"mpic-bench-{uuid.uuid4().hex}"
        return self.driver.request(parts, policy, steps, plain=False, cache_salt=salt, **options)

    def run(self, parts: list[PromptPart], policy: str, steps: int) -> dict[str, Any]:
        """Greedy `steps` tokens with per-step log-probs [V], KV bytes held and decode time."""
        run = self.driver.run
        # untimed: per-step log-probs over the whole vocabulary
        captured: list[FirstToken] = []
        request = self._request(parts, policy, steps, capture_steps=True, capture_top_k=-1)
        tokens, prefill = run(request, captured)
        # timed without log-probs (building a vocabulary-sized dict per step would dominate)
        t0 = time.perf_counter()
        run(self._request(parts, policy, steps))
        t_steps = time.perf_counter() - t0
        t0 = time.perf_counter()
        run(self._request(parts, policy, 1))
        t_one = time.perf_counter() - t0
        n = prefill.prompt_tokens
        blocks = math.ceil((n + steps) / self.block_size)
        return {
            "tokens": tokens,
            "logits": [first_token_logits(c, self.spec.vocab_size) for c in captured],
            "prompt_tokens": n,
            "kv_bytes": blocks * self.block_size * self.token_bytes,
            "ms_per_token": 1e3 * max(t_steps - t_one, 0.0) / (steps - 1),
        }

    def close(self) -> None:
        """Close the driver's loop and stop vLLM's processes."""
        self.driver.close()
        self.engine.close()


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


def run_compress_vllm(
    bench: VllmCompressBench,
    prompts: list[list[PromptPart]],
    policy: str,
    presses: list[str],
    budgets: list[float],
    steps: int,
) -> list[dict[str, Any]]:
    """The rows of the table, as `mpic.benchmarks.compress.bench.run_compress`'s."""
    bench.run(prompts[0], policy, steps)  # warm-up (first decode steps), not counted
    refs = [bench.run(p, policy, steps) for p in prompts]
    full_bytes = statistics.mean(r["kv_bytes"] for r in refs)
    rows: list[dict[str, Any]] = [baseline_row(refs)] if 1.0 in budgets else []
    for press in presses:
        for budget in [b for b in budgets if b < 1.0]:
            runs = [bench.run(bench.pressed(p, press, budget), policy, steps) for p in prompts]
            pairs = list(zip(refs, runs, strict=True))
            rows.append(
                press_row(
                    press,
                    budget,
                    [r["kv_bytes"] for r in runs],
                    full_bytes,
                    [r["ms_per_token"] for r in runs],
                    [_common_kl(ref, got) for ref, got in pairs],
                    [float(ref["tokens"][0] == got["tokens"][0]) for ref, got in pairs],
                    [
                        statistics.mean(float(a == b) for a, b in zip(*tok, strict=True))
                        for tok in ((ref["tokens"], got["tokens"]) for ref, got in pairs)
                    ],
                    statistics.mean(r["prompt_tokens"] for r in runs),
                )
            )
    return rows
