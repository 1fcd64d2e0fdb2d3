"""The measuring code of `mpic bench compress` (CLI process), the same for both engines: the
benchmark's requests to one `mpic.engine.protocol.Engine` through the offline benchmark's
`Driver` (`CompressBench`), and the table's rows from them (`run_compress`: per (press, budget)
means over the prompts, and the uncompressed `none` row). The columns are defined in
`mpic.benchmarks.compress.bench`'s docstring; `CompressBench` measures them as the reference
engine can, `mpic.benchmarks.compress.vllm_bench.VllmCompressBench` as vLLM can."""

from __future__ import annotations

import logging
import statistics
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mpic.benchmarks.offline.bench import kl_divergence
from mpic.benchmarks.offline.engines import Driver, first_token_logits
from mpic.samples import interleaved_prompt, synthetic_png

if TYPE_CHECKING:
    import torch

    from mpic.engine.first_token import FirstToken
    from mpic.engine.protocol import Engine, GenerateRequest, Prefill
    from mpic.prompt_parts import PromptPart

logger = logging.getLogger(__name__)


def kl_steps(ref: list[torch.Tensor], got: list[torch.Tensor]) -> list[float]:
    """KL(p_ref || p) per step (nats) of two lists of logits [V]."""
    return [kl_divergence(r, g) for r, g in zip(ref, got, strict=False)]


class CompressBench:
    """The benchmark's requests to one `Engine` (the reference engine,
    `mpic.engine.hf.engine.ReferenceEngine`) through `Driver`, with the items it cached. Every
    run is a linked greedy request of `steps` tokens (`plain=False`, a fresh `cache_salt`) that
    captures every step's distribution (`GenerateRequest.capture_steps`, the whole vocabulary)
    and names the press (`GenerateRequest.press`: the reference engine compresses the whole
    prompt KV after the prefill). The KV bytes are the backend's (`Prefill.kv_bytes`), the
    decode time per token the mean gap between the arrivals of the steps; each press run is also
    teacher-forced on the reference's tokens (`GenerateRequest.forced_ids`: `pressed_run`)."""

    warm_up = False
    """Run one uncounted request before the reference runs."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.spec = engine.spec
        self.driver = Driver(engine)
        self.entries = self.driver.entries

    def prompts(self, count: int, per_prompt: int, items: str = "images") -> list[list[PromptPart]]:
        """`count` prompts of `per_prompt` synthetic images, or standard-library passages cached
        as text documents with a question (`items="documents"`,
        `mpic.benchmarks.fidelity.bench`'s prompts), their entries computed by the engine."""
        if items == "documents":
            from mpic.benchmarks.fidelity.prompts import passages, question_parts

            docs = passages(per_prompt * count)
            out = []
            for p in range(count):
                mine = docs[p * per_prompt : (p + 1) * per_prompt]
                ids = [self.driver.add_document(d.text) for d in mine]
                out.append(question_parts(mine, ids, p))
            return out
        return [
            interleaved_prompt(
                [self.driver.add_image(synthetic_png(100 * p + i)) for i in range(per_prompt)]
            )
            for p in range(count)
        ]

    def request(
        self,
        parts: list[PromptPart],
        policy: str,
        steps: int,
        press: str | None = None,
        budget: float | None = None,
        **options: Any,
    ) -> GenerateRequest:
        """The greedy linked request of `steps` tokens (`full` too: never plain), salted: no
        prefix-cache hit between runs."""
        salt = f"mpic-bench-{uuid.uuid4().hex}"
        return self.driver.request(
            parts, policy, steps, plain=False, cache_salt=salt, press=press, budget=budget,
            **options,
        )  # fmt: skip

    def run(
        self,
        parts: list[PromptPart],
        policy: str,
        steps: int,
        press: str | None = None,
        budget: float | None = None,
        forced: Sequence[int] = (),
    ) -> dict[str, Any]:
        """`steps` greedy tokens (the `forced` ones first) with every step's logits [V], the
        prompt's tokens, the KV bytes held and the decode time per token."""
        captured: list[FirstToken] = []
        stamps: list[float] = []
        request = self.request(
            parts, policy, steps, press, budget, capture_steps=True, capture_top_k=-1,
            forced_ids=list(forced),
        )  # fmt: skip
        tokens, prefill = self.driver.run(request, captured, stamps)
        return {
            "tokens": tokens,
            "logits": [first_token_logits(c, self.spec.vocab_size) for c in captured],
            "prompt_tokens": prefill.prompt_tokens,
            "kv_bytes": self.kv_bytes(prefill, steps),
            "ms_per_token": self.ms_per_token(stamps, parts, policy, steps),
        }

    def kv_bytes(self, prefill: Prefill, steps: int) -> int:
        """Bytes of KV held while decoding: the backend's (`Prefill.kv_bytes`)."""
        if prefill.kv_bytes is None:
            raise ValueError("the engine does not report the KV bytes it holds (Prefill.kv_bytes)")
        return prefill.kv_bytes

    def ms_per_token(
        self, stamps: list[float], parts: list[PromptPart], policy: str, steps: int
    ) -> float:
        """Wall ms per decoded token after the first: the mean gap between the steps' arrivals
        (one token per step)."""
        return 1e3 * (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0

    def pressed_run(
        self,
        ref: dict[str, Any],
        parts: list[PromptPart],
        policy: str,
        steps: int,
        press: str,
        budget: float,
    ) -> tuple[dict[str, Any], float, float]:
        """The free-running run of `parts` under `press` at `budget`, and its `kl_mean` and
        `top1_match` against the reference run `ref`, both over a run teacher-forced on `ref`'s
        tokens (every step in the reference's context)."""
        forced = self.run(parts, policy, steps, press, budget, ref["tokens"])
        free = self.run(parts, policy, steps, press, budget)
        kl = statistics.mean(kl_steps(ref["logits"], forced["logits"]))
        pairs = zip(forced["logits"], ref["tokens"], strict=True)
        top1 = statistics.mean(float(int(g.argmax()) == t) for g, t in pairs)
        return free, kl, top1

    def close(self) -> None:
        """Close the driver's loop (the engine stays up)."""
        self.driver.close()


def run_compress(
    bench: CompressBench,
    prompts: list[list[PromptPart]],
    policy: str,
    presses: list[str],
    budgets: list[float],
    steps: int,
) -> list[dict[str, Any]]:
    """The rows of the table (one per press and budget; budget 1.0 once, as `none`): per prompt
    the uncompressed run (same policy, no press) is the reference of its press runs."""
    if bench.warm_up:
        bench.run(prompts[0], policy, steps)  # first decode steps, not counted
    refs = [bench.run(p, policy, steps) for p in prompts]
    full_bytes = statistics.mean(r["kv_bytes"] for r in refs)
    rows: list[dict[str, Any]] = [baseline_row(refs)] if 1.0 in budgets else []
    for press in presses:
        for budget in [b for b in budgets if b < 1.0]:
            runs, kl, top1, agree = [], [], [], []
            for parts, ref in zip(prompts, refs, strict=True):
                free, k, t = bench.pressed_run(ref, parts, policy, steps, press, budget)
                runs.append(free)
                kl.append(k)
                top1.append(t)
                agree.append(
                    statistics.mean(
                        float(a == b) for a, b in zip(free["tokens"], ref["tokens"], strict=True)
                    )
                )
            rows.append(
                press_row(
                    press,
                    budget,
                    [r["kv_bytes"] for r in runs],
                    full_bytes,
                    [r["ms_per_token"] for r in runs],
                    kl,
                    top1,
                    agree,
                    statistics.mean(r["prompt_tokens"] for r in runs),
                )
            )
            logger.info("%s @ %s done", press, budget)
    return rows


def baseline_row(refs: list[dict[str, Any]]) -> dict[str, Any]:
    """The `none` row (budget 1.0) from the uncompressed runs (`kv_bytes`, `ms_per_token`,
    `prompt_tokens` each)."""
    full_bytes = statistics.mean(r["kv_bytes"] for r in refs)
    return press_row(
        "none",
        1.0,
        [full_bytes],
        full_bytes,
        [r["ms_per_token"] for r in refs],
        [0.0],
        [1.0],
        [1.0],
        statistics.mean(r["prompt_tokens"] for r in refs),
    )


def press_row(
    press: str,
    budget: float,
    kv_bytes: list[float],
    full_bytes: float,
    ms: list[float],
    kl: list[float],
    top1: list[float],
    agree: list[float],
    prompt_tokens: float,
) -> dict[str, Any]:
    """One table row from per-prompt figures (means over the prompts)."""
    held = statistics.mean(kv_bytes)
    return {
        "press": press,
        "budget": budget,
        "kv_bytes": held,
        "kv_bytes_full": full_bytes,
        "kv_reduction": 1.0 - held / full_bytes,
        "decode_ms_per_token": statistics.mean(ms),
        "kl_mean": statistics.mean(kl),
        "top1_match": statistics.mean(top1),
        "token_agreement": statistics.mean(agree),
        "prompt_tokens": prompt_tokens,
    }
