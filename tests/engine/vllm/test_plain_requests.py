"""Fast checks (no engine) of the vLLM backend's request options the offline benchmark uses:
a `plain` request names an exact policy and carries its images' media, and a pass's
`Prefill.recomputed_tokens` (a linked request's by its plan, a plain one's less vLLM's own
prefix-cache hits)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mpic.engine.protocol import GenerateRequest
from mpic.engine.vllm.async_engine import _check_plain, recomputed_tokens
from mpic.engine.vllm.requests import EngineRequest, EngineResult
from mpic.errors import InvalidRequestError
from mpic.prompt_parts import ImageRef


def _request(policy: str) -> GenerateRequest:
    return GenerateRequest(["look", ImageRef("a")], {}, policy, plain=True)


def test_a_plain_request_runs_an_exact_policy_with_its_media() -> None:
    parts = ["look", ImageRef("a")]
    for policy in ("full", "prefix"):
        _check_plain(_request(policy), parts, {"a": b"png"})
    with pytest.raises(InvalidRequestError, match="plain request runs full or prefix"):
        _check_plain(_request("mpic-32"), parts, {"a": b"png"})
    with pytest.raises(InvalidRequestError, match=r"media of its images \['a'\]"):
        _check_plain(_request("full"), parts, None)


def test_recomputed_tokens_by_plan_or_prefix_cache_hits() -> None:
    plan = SimpleNamespace(
        num_tokens=6,
        recompute_depth=torch.tensor([4, 4, 0, 0, 2, 4]),
        is_text=torch.tensor([True, True, False, False, False, True]),
    )
    one_step = SimpleNamespace(plan=plan, policy=SimpleNamespace(two_step=False))
    two_step = SimpleNamespace(plan=plan, policy=SimpleNamespace(two_step=True))
    linked = EngineRequest([1, 2, 3], plan=plan)  # type: ignore[arg-type]
    plain = EngineRequest([1, 2, 3])
    hits = EngineResult([7], num_cached_tokens=4)
    assert (
        recomputed_tokens(one_step, plan, linked, hits) == 4
    )  # its salted blocks: relinked anyway
    assert recomputed_tokens(two_step, plan, linked, hits) == 4  # the text is recomputed already
    plan.recompute_depth = torch.tensor([0, 4, 0, 0, 2, 4])
    assert recomputed_tokens(two_step, plan, linked, hits) == 4  # text again in the second step
    assert recomputed_tokens(one_step, plan, linked, hits) == 3
    assert recomputed_tokens(one_step, plan, plain, hits) == 2  # vLLM's prefix cache served 4
    fell_back = EngineResult([7], num_cached_tokens=0, fell_back=True)
    assert recomputed_tokens(one_step, plan, linked, fell_back) == 6
