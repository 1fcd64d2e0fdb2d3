"""`mpic bench offline --engine vllm`: the offline benchmark's engine over vLLM (CLI process).

Implements `mpic.benchmarks.offline.engines.BenchEngine` with `VllmEngine` (float32 on CPU).
Policies:
- `full`: plain vLLM, every run with a fresh `cache_salt` (no prefix reuse at all);
- `prefix`: plain vLLM with its own prefix caching, as in the MPIC paper's Fig. 3: the same
  images, a NEW opening text for every timed run, so only the shared system prompt can hit;
- any other policy: an MPIC linked request (plan with the policy's depths, KV linked by the
  connector in the worker; its salted blocks may hit vLLM's cache on repeats, but the connector
  relinks the whole prompt every time, so the work is timed in full).
TTFT = wall time of a 1-token request from the prompt parts (planning included) with the
entries resident in the worker's memory tier; `cpu_ms` = this process's CPU time plus that of
vLLM's worker process over the same request (robust to a busy shared host). First-token
log-probs for the KL come from one untimed run with the full vocabulary's log-probs.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from tempfile import mkdtemp

from mpic.benchmarks.offline.timed_prefill import TimedPrefill
from mpic.engine.vllm.engine import VllmEngine, VllmEngineConfig
from mpic.engine.vllm.requests import EngineRequest
from mpic.linker.prompt import PromptPart
from mpic.storage.config import StorageConfig
from mpic.types import CacheEntry, LinkPlan

EXACT_POLICIES = ("full", "prefix")


class VllmBenchEngine:
    """vLLM + the MPIC connector behind the offline benchmark's engine interface."""

    name = "vllm"

    def __init__(self, model_dir: str, system_prompt: str | None = None) -> None:
        store = StorageConfig(url=f"file://{mkdtemp(prefix='mpic-vllm-bench-')}", fsync=False)
        self.engine = VllmEngine(VllmEngineConfig(model=model_dir, max_logprobs=-1, storage=store))
        self.spec = self.engine.spec
        self.system_prompt = system_prompt
        self.entries: dict[str, CacheEntry] = {}
        self.media: dict[str, bytes] = {}

    def cache_image(self, media: bytes) -> CacheEntry:
        """Compute the image's entry through vLLM (it stays in the worker's memory tier)."""
        entry = self.engine.cache_image(media, self.system_prompt)
        self.entries[entry.entry_id] = entry
        self.media[entry.entry_id] = media
        return entry

    def _request(self, parts: Sequence[PromptPart], policy: str) -> tuple[EngineRequest, int, int]:
        """The request for `parts` under `policy` (`VllmFrontEnd.prepare`: plain vLLM with the
        images for `full` and `prefix`), its prompt and recomputed token counts."""
        exact = policy in EXACT_POLICIES
        media = self.media if exact else None  # a linked run that cannot link fails loudly
        planned, request = self.engine.prepare(
            parts, self.entries, policy, self.system_prompt, media=media, exact=exact
        )
        plan = planned.plan
        if exact:
            return request, plan.num_tokens, plan.num_tokens
        return request, plan.num_tokens, _recomputed(plan, planned.policy.two_step)

    def first_token(self, parts: Sequence[PromptPart], policy: str) -> TimedPrefill:
        """Time one first token; see the module docstring for how each policy is run."""
        timed = parts
        if policy == "prefix":  # a new opening text each time (paper Fig. 3)
            timed = [f"({uuid.uuid4().hex[:8]}) {parts[0]}", *parts[1:]]
        cpu0, worker0 = time.process_time(), self.engine.worker_cpu_s()
        began = time.perf_counter()
        request, _, recomputed = self._request(timed, policy)
        if policy == "full":
            request.cache_salt = f"full-{uuid.uuid4().hex}"
        (result,) = self.engine.generate([request], max_tokens=1)
        ttft = time.perf_counter() - began
        cpu = time.process_time() - cpu0 + self.engine.worker_cpu_s() - worker0
        if policy == "prefix":
            recomputed -= result.num_cached_tokens
        request, prompt_tokens, _ = self._request(parts, policy)
        (scored,) = self.engine.generate([request], max_tokens=1, logprobs=True)
        return TimedPrefill(
            ttft_s=ttft,
            logits=scored.logprobs,
            prompt_tokens=prompt_tokens,
            recomputed_tokens=recomputed,
            cpu_s=cpu,
        )

    def greedy(self, parts: Sequence[PromptPart], policy: str, max_new_tokens: int) -> list[int]:
        """Exactly `max_new_tokens` greedy tokens under `policy`."""
        request, _, _ = self._request(parts, policy)
        (result,) = self.engine.generate([request], max_tokens=max_new_tokens, ignore_eos=True)
        return result.token_ids


def _recomputed(plan: LinkPlan, two_step: bool) -> int:
    """Prompt tokens that run through at least one layer (text again for two-step policies)."""
    ran = plan.recompute_depth > 0
    if two_step:
        ran |= plan.is_text
    return int(ran.sum())
