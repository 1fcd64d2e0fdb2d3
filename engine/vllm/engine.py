"""vLLM V1 offline engine with the MPIC connector (offline scripts, tests; no CLI command or
benchmark drives it: they drive `mpic.engine.vllm.async_engine.AsyncVllmEngine` through the
engine protocol): vLLM's `LLM` generates a batch of exact and linked requests synchronously
(continuous batching inside the call). Runs in the process that owns the engine; the CPU set-up
and engine arguments are in `mpic.engine.vllm.startup`, what it shares with the async engine
(the Serve LLM worker's) in `mpic.engine.vllm.frontend`; the config names are re-exported here.
"""

from __future__ import annotations

from typing import Any

import torch

from mpic.engine.vllm.config import VllmEngineConfig
from mpic.engine.vllm.frontend import VllmFrontEnd
from mpic.engine.vllm.requests import EngineRequest, EngineResult
from mpic.engine.vllm.startup import engine_kwargs, prepare_environment

__all__ = ["VllmEngine", "VllmEngineConfig", "prepare_environment"]


class VllmEngine(VllmFrontEnd):
    """A vLLM `LLM` with the MPIC connector; greedy generation of exact and linked requests."""

    def __init__(self, cfg: VllmEngineConfig) -> None:
        super().__init__(cfg)
        from vllm import LLM

        self.llm = LLM(**engine_kwargs(cfg))

    def connector_stats(self) -> dict[str, int]:
        """The worker connector's linking counters (`link_passes`, `linked_requests`,
        `largest_pass`, `failed`)."""
        (stats,) = self.llm.collective_rpc("mpic_connector_stats")  # `mpic.engine.vllm.plugin`
        return stats

    def generate(
        self,
        requests: list[EngineRequest],
        max_tokens: int = 8,
        logprobs: bool = False,
        ignore_eos: bool = False,
    ) -> list[EngineResult]:
        """Greedy-decode `requests` together (continuous batching) until EOS
        (`ModelSpec.end_token_ids`, included in `token_ids`) or `max_tokens` (`ignore_eos`:
        always `max_tokens`, as benchmarks do); linked requests whose entries fail to load are
        answered by their `fallback` (logged, counted in `self.fallbacks`). With `logprobs`,
        each result carries the first token's log-probs over the vocabulary (needs
        `max_logprobs=-1`)."""
        forms = [
            self._submit_form(r, max_tokens, logprobs, ignore_eos=ignore_eos) for r in requests
        ]
        outputs = self.llm.generate([f[0] for f in forms], [f[1] for f in forms], use_tqdm=False)
        results = []
        retry: list[int] = []
        for i, out in enumerate(outputs):
            completion = out.outputs[0]
            if self.link_failed(requests[i], completion.finish_reason):
                retry.append(i)
            results.append(
                EngineResult(
                    token_ids=list(completion.token_ids),
                    num_cached_tokens=int(out.num_cached_tokens or 0),
                    logprobs=self._first_logprobs(completion.logprobs) if logprobs else None,
                    finish_reason=completion.finish_reason,
                )
            )
        if retry:
            self._recompute(requests, results, retry, max_tokens, logprobs, ignore_eos)
        return results

    def _first_logprobs(self, steps: Any) -> torch.Tensor | None:
        if not steps:
            return None
        out = torch.full((self.spec.vocab_size,), float("-inf"))
        for token_id, entry in steps[0].items():
            out[token_id] = entry.logprob
        return out

    def _recompute(
        self,
        requests: list[EngineRequest],
        results: list[EngineResult],
        retry: list[int],
        max_tokens: int,
        logprobs: bool,
        ignore_eos: bool,
    ) -> None:
        exact = self._fallbacks([requests[i] for i in retry])
        again = self.generate(exact, max_tokens, logprobs, ignore_eos)
        for i, res in zip(retry, again, strict=True):
            res.fell_back = True
            results[i] = res

    def _run_to_end(self, prompt: dict, sampling: Any) -> None:
        """One request (an upload or a compression) through `LLM.generate`, to its end."""
        self.llm.generate([prompt], [sampling], use_tqdm=False)

    def metric(self, name: str) -> float:
        """A vLLM counter/gauge summed over labels, e.g. "vllm:num_preemptions" (needs
        `log_stats`)."""
        return float(sum(getattr(m, "value", 0) for m in self.llm.get_metrics() if m.name == name))

    def close(self) -> None:
        """Stop vLLM's engine-core and worker processes."""
        self.llm.llm_engine.engine_core.shutdown()
