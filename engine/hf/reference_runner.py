"""The reference runner: HF weights on CPU or CUDA driven by the linker's one-pass selective
prefill, then greedy or sampled decoding (reference-runner process: benchmarks, demo, tests,
and the Serve LLM worker when configured without vLLM).

A request goes: render the chat template -> resolve entries (NotFoundError) -> link plan
(PromptTooLongError) -> policy -> link rotated KV + selective prefill -> first token -> decode.
Every check runs before any KV is allocated or written. TTFT is measured from the request to the
first token with entries already in memory (MPIC paper section 5.2's setting).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from mpic.engine.hf.adapters import make_adapter
from mpic.engine.hf.compress import (
    PressRequest,
    compress_dense,
    observed,
    observer_for,
    press_entry_dense,
)
from mpic.engine.hf.entries import cache_document, cache_image
from mpic.engine.hf.loader import load_hf_model
from mpic.engine.protocol import Sampling
from mpic.engine.request_flow import plan_parts, policy_of
from mpic.engine.sampling import Sampler
from mpic.kernels.attention import default_backend_name
from mpic.kernels.attention_backend import AttentionBackend
from mpic.linker.chat_template import ChatTemplateOptions
from mpic.linker.kv.dense import DenseLinkedKV
from mpic.linker.pipeline import link_and_prefill
from mpic.linker.policies import Policy
from mpic.linker.policies.scout_scales import load_table as load_scale_table
from mpic.linker.positions import next_position
from mpic.linker.prefix import PrefixCache, takes_prefix
from mpic.linker.prompt import PromptPart
from mpic.linker.recipe import PlannedPrompt
from mpic.linker.scout import ScoutReport
from mpic.linker.selective_prefill import run_layers
from mpic.presses.cache import CompressedKV
from mpic.presses.entries import press_entry_id
from mpic.presses.registry import check_budget, get_press
from mpic.types import CacheEntry, LinkPlan

logger = logging.getLogger(__name__)


@dataclass
class Prefilled:
    """A prompt after the selective prefill: its plan, filled KV and first-token logits."""

    plan: LinkPlan
    kv: DenseLinkedKV | CompressedKV
    """The KV decoding runs over: dense, or compressed by the request's press."""
    logits: torch.Tensor
    """float32 [vocab] of the last prompt token."""
    recomputed_tokens: int
    ttft_s: float
    """Seconds from the request to the first token (argmax of `logits`)."""
    cpu_s: float
    """Process CPU seconds over the same span (all threads): the work, robust to a busy host."""
    press: PressRequest | None = None
    """The press that compressed `kv` (its generation-time step runs while decoding)."""
    scout: ScoutReport | None = None
    """The scouting pass's cost (`scout-*` policies)."""
    cached_prefix: int = 0
    """Leading prompt tokens linked exactly from the prefix cache (`link_prefix`): counted as
    cached, not recomputed."""


@dataclass
class Generation:
    """Generated token ids and the prefill's numbers."""

    tokens: list[int]
    prefilled: Prefilled


class ReferenceRunner:
    """One HF model, an in-memory entry table and the MPIC linking path: the reference backend
    of `mpic.engine.protocol.Engine`."""

    def __init__(
        self,
        model_dir: str,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        system_prompt: str | None = None,
        attention_backend: str | AttentionBackend | None = None,
        decode_correction: bool = False,
        link_prefix: bool = True,
        compile_layers: bool | None = None,
        compile_backend: str = "inductor",
    ) -> None:
        """attention_backend: `mpic.kernels.attention` backend of the linked KV (`flex`,
        `sdpa_runs`, or a configured instance); None picks by device (`flex` on CUDA).
        decode_correction: keep a policy's linked-key correction (`scout-*`, `auto`) while decoding
        (default False: decode with plain attention, as the vLLM worker does, so both engines give
        the same tokens; plain decoding also followed the exact answer better under `auto`,
        docs/fidelity.md). link_prefix: link the template/system prefix shared with the entries'
        canonical context exactly from a prefix cache instead of recomputing it
        (`mpic.linker.prefix`; every policy but `full` and `prefix`, two-step and in-pass-hook
        policies recompute it; on by default, as in the vLLM worker, so both engines select the same
        tokens; False: recompute it). compile_layers: compile the layer step
        (`mpic.engine.hf.adapters.HFLayerAdapter`; None: on CUDA) with dynamo's
        `compile_backend`."""
        self.model, self.processor, self.spec = load_hf_model(model_dir, device, dtype)
        self.adapter = make_adapter(self.model, compile_layers, compile_backend)
        self.attention_backend = attention_backend
        chosen = attention_backend or default_backend_name(self.adapter.device)
        if chosen == "sdpa_runs" and self.adapter.device.type == "cuda":
            logger.warning(
                "attention backend sdpa_runs on CUDA: it is the CPU oracle (many small calls "
                "per layer) and ran 3-90x slower than flex on an H200; flex is the CUDA default"
            )
        self.decode_correction = decode_correction
        self.scout_scales = load_scale_table(model_dir, self.adapter.num_layers)
        """The model's own (budget, S) table for `scout-*` / `auto` names, or None (default)."""
        self.system_prompt = system_prompt
        self.entries: dict[str, CacheEntry] = {}
        self.prefixes = PrefixCache(self.adapter, self.spec.family) if link_prefix else None
        """Context KV for `link_prefix` (None: the prefix is recomputed)."""

    def policy_of(self, policy: str | Policy) -> Policy:
        """A request's policy: a name parsed once, against the model's own scout scales
        (`scout_scales`), where it enters the runner (`generate`, `stream`, `prefill`, `plan`:
        the parsed policy is what they hand down); a policy object as given."""
        return policy_of(policy, self.scout_scales)

    def _system(self, system_prompt: str | None) -> str | None:
        """A request's system prompt, or None for the runner's own."""
        return self.system_prompt if system_prompt is None else system_prompt

    def cache_image(self, media: bytes, system_prompt: str | None = None) -> CacheEntry:
        """Compute (or reuse) the entry of an image and keep it in memory."""
        system = self._system(system_prompt)
        entry = cache_image(self.model, self.processor, self.adapter, self.spec, media, system)
        return self.entries.setdefault(entry.entry_id, entry)

    def cache_document(self, text: str, system_prompt: str | None = None) -> CacheEntry:
        """Compute (or reuse) the entry of a text document and keep it in memory."""
        system = self._system(system_prompt)
        entry = cache_document(self.processor, self.adapter, self.spec, text, system)
        return self.entries.setdefault(entry.entry_id, entry)

    def add_entry(self, entry: CacheEntry) -> None:
        """Make an entry (e.g. read from storage) linkable."""
        self.entries[entry.entry_id] = entry

    def press_entry(self, entry: CacheEntry, press: str, budget: float) -> CacheEntry:
        """The uniform-across-layers variant of `press` on a cached item: its compressed entry
        (`mpic.presses.entries`, chosen from the item's canonical prefill,
        `mpic.engine.item_press`), kept linkable beside the full one; link it (its `entry_id`)
        instead of `entry`'s to shorten the prompt. Budget 1.0 gives `entry` itself."""
        get_press(press)  # ValueError for an unknown press, whatever the budget
        if check_budget(budget) >= 1.0:  # nothing to compress: the entry itself
            return entry
        key = press_entry_id(entry.entry_id, press, budget)
        if key not in self.entries:
            self.entries[key] = press_entry_dense(
                self.adapter, self.spec, entry, press, budget, self.attention_backend
            )
        return self.entries[key]

    def plan(
        self,
        parts: Sequence[PromptPart],
        policy: str | Policy = "full",
        max_new_tokens: int = 0,
        system_prompt: str | None = None,
        *,
        entries: Mapping[str, CacheEntry] | None = None,
        raw: bool = False,
        template: ChatTemplateOptions | None = None,
    ) -> PlannedPrompt:
        """The finished link plan of a prompt under `policy` (`mpic.engine.request_flow
        .plan_parts`); raises on bad input. system_prompt: this request's, or None for the
        runner's own; entries: the request's linkable entries (default: the runner's table);
        raw: a completion prompt (no chat template); template: the chat template's options
        (`GenerateRequest.template`; None: the default rendering)."""
        policy = self.policy_of(policy)
        table = self.entries if entries is None else entries
        system = self._system(system_prompt)
        planned = plan_parts(
            self.spec, self.processor, parts, table, policy, system, max_new_tokens, raw, template
        )
        if self.prefixes is not None and takes_prefix(
            policy, planned.plan, self.adapter.num_layers
        ):
            prefix = self.prefixes.lookup(planned.plan, planned.entries)
            planned = dataclasses.replace(planned, prefix=prefix)
        return planned

    @torch.inference_mode()
    def prefill(
        self,
        parts: Sequence[PromptPart],
        policy: str | Policy,
        max_new_tokens: int = 0,
        system_prompt: str | None = None,
        press: str | None = None,
        budget: float | None = None,
        *,
        entries: Mapping[str, CacheEntry] | None = None,
        raw: bool = False,
        template: ChatTemplateOptions | None = None,
    ) -> Prefilled:
        """Link and prefill a prompt under `policy`; room for `max_new_tokens` is reserved.
        press/budget (`mpic.presses`): compress the prompt KV after the prefill, before the
        first decode step; budget 1.0 or no press keeps the dense KV (ValueError for an unknown
        press or a budget outside (0, 1], before any work). entries, raw, template: as
        `plan`'s."""
        req = PressRequest.make(press, budget)
        policy = self.policy_of(policy)
        start, cpu_start = time.perf_counter(), time.process_time()
        planned = self.plan(
            parts,
            policy,
            max_new_tokens,
            system_prompt,
            entries=entries,
            raw=raw,
            template=template,
        )
        plan = planned.plan
        a = self.adapter
        kv = DenseLinkedKV(
            a.num_layers,
            plan.num_tokens + max_new_tokens,
            a.num_kv_heads,
            a.head_dim,
            a.dtype,
            a.device,
            backend=self.attention_backend,
            heads_major=True,  # each layer's K/V as the kernels read them: no copy per layer
        )
        if req is None:
            out = link_and_prefill(a, planned, kv)
        else:
            observer = observer_for(plan, a)
            observed_adapter, observed_kv = observed(a, kv, observer)
            out = link_and_prefill(observed_adapter, planned, observed_kv)
        logits = out.result.logits
        int(logits.argmax())  # the first token exists once it is picked
        ttft, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        if req is not None:  # compress, then drop the dense KV (memory freed)
            kv = compress_dense(req, kv, observer, out.plan, a, max_new_tokens)
        if not self.decode_correction and isinstance(kv, DenseLinkedKV):
            kv.set_correction(None)  # decode as vLLM does: plain attention
        return Prefilled(
            out.plan,
            kv,
            logits,
            out.recomputed_tokens,
            ttft,
            cpu,
            req,
            scout=out.scout,
            cached_prefix=out.cached_prefix,
        )

    @torch.inference_mode()
    def stream(
        self,
        parts: Sequence[PromptPart],
        policy: str | Policy = "mpic-32",
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        seed: int | None = None,
        stop_at_eos: bool = True,
        system_prompt: str | None = None,
        pick: Callable[[torch.Tensor], int] | None = None,
        press: str | None = None,
        budget: float | None = None,
        *,
        entries: Mapping[str, CacheEntry] | None = None,
        raw: bool = False,
        template: ChatTemplateOptions | None = None,
        continue_from: Sequence[int] = (),
        on_prefill: Callable[[Prefilled], None] | None = None,
    ) -> Iterator[tuple[int, Prefilled]]:
        """Prefill, then yield (token id, prefill) as each token is decoded (greedy when
        temperature is 0, else seeded sampling: `mpic.engine.sampling.Sampler`; `pick(logits
        [V]) -> token id` replaces it, e.g. a Sampler over a request's whole `Sampling`); stops
        after an end id (`ModelSpec.end_token_ids`, the same ids the vLLM engine stops at; the
        end token is yielded) or `max_new_tokens`. entries, raw, template: as `plan`'s.
        continue_from: tokens already generated (`GenerateRequest.continue_from`): decoded first,
        in place of picks, and not yielded; `max_new_tokens` more follow. on_prefill: called with
        the prefill before the first pick (a `Sampler` takes the prompt's ids from its plan)."""
        policy = self.policy_of(policy)
        forced = list(continue_from)
        total = len(forced) + max_new_tokens
        pre = self.prefill(
            parts,
            policy,
            total,
            system_prompt,
            press,
            budget,
            entries=entries,
            raw=raw,
            template=template,
        )
        if on_prefill is not None:
            on_prefill(pre)
        if pick is None:
            pick = Sampler(Sampling(temperature=temperature, seed=seed))
        pos0, n, a = next_position(pre.plan.positions), pre.plan.num_tokens, self.adapter
        logits = pre.logits
        for step in range(total):
            if step < len(forced):
                token = forced[step]
            else:
                token = pick(logits)
                yield token, pre
                if (stop_at_eos and token in self.spec.end_token_ids) or step == total - 1:
                    return
            pos = torch.tensor([pos0 + step])
            if pre.plan.positions.dim() == 2:
                pos = pos.expand(3, 1)
            hidden, _, _ = run_layers(
                a,
                pre.kv,
                a.embed_tokens(torch.tensor([token])),
                torch.tensor([n + step]),
                pos,
                torch.tensor([a.num_layers]),
            )
            logits = a.logits(hidden)[0]
            if pre.press is not None:  # Elastic Cache's fixed-point elimination
                pre.press.press.after_decode_step(pre.kv, n + step + 1)

    def generate(
        self,
        parts: Sequence[PromptPart],
        policy: str | Policy = "mpic-32",
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        seed: int | None = None,
        stop_at_eos: bool = True,
        system_prompt: str | None = None,
        press: str | None = None,
        budget: float | None = None,
    ) -> Generation:
        """All of `stream`'s tokens at once."""
        policy = self.policy_of(policy)
        steps = list(
            self.stream(
                parts,
                policy,
                max_new_tokens,
                temperature,
                seed,
                stop_at_eos,
                system_prompt,
                press=press,
                budget=budget,
            )
        )
        if not steps:  # max_new_tokens == 0: prefill only
            return Generation([], self.prefill(parts, policy, 0, system_prompt, press, budget))
        return Generation([t for t, _ in steps], steps[0][1])
