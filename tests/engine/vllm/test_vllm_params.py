"""Fast checks of the vLLM glue that needs no engine: the plan codec carried in
`kv_transfer_params`, the prefix-cache salt, prompt placeholders, run splitting, the config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from mpic.engine.vllm import params as vllm_params
from mpic.engine.vllm.engine import VllmEngineConfig
from mpic.engine.vllm.requests import collapse_placeholders
from mpic.errors import InvalidRequestError
from mpic.kernels.sdpa_runs import query_runs as contiguous_runs
from mpic.types import LinkPlan


def _plan(mrope: bool) -> LinkPlan:
    n = 40
    src = torch.full((n,), -1, dtype=torch.int64)
    off = torch.full((n,), -1, dtype=torch.int64)
    src[5:21], off[5:21] = 0, torch.arange(16)
    src[25:41], off[25:41] = 1, torch.arange(15)
    pos = torch.arange(n)
    if mrope:
        pos = torch.stack([pos, pos.flip(0), pos % 7])
    depth = torch.where(src < 0, 4, 0)
    depth[5:9] = 4
    return LinkPlan(
        token_ids=torch.randint(0, 100, (n,)),
        positions=pos,
        source_entry=src,
        source_offset=off,
        entry_ids=["a" * 64, "b" * 64],
        recompute_depth=depth,
    )


@pytest.mark.parametrize("mrope", [False, True])
def test_plan_round_trips_through_params(mrope: bool) -> None:
    plan = _plan(mrope)
    params = vllm_params.plan_to_params(plan, "mpic-4")
    assert vllm_params.is_linked(params) and not vllm_params.is_linked({"other": 1})
    back, policy = vllm_params.plan_from_params(params, plan.token_ids.tolist())
    assert policy == "mpic-4" and back.entry_ids == plan.entry_ids
    for name in ("token_ids", "positions", "source_entry", "source_offset", "recompute_depth"):
        assert torch.equal(getattr(back, name), getattr(plan, name)), name
    assert len(params["mpic"]["source_offset"]) <= 6  # run-length coded, not one int per token


def test_params_that_do_not_fit_the_prompt_are_rejected() -> None:
    plan = _plan(False)
    params = vllm_params.plan_to_params(plan, "full")
    with pytest.raises(InvalidRequestError):
        vllm_params.plan_from_params(params, plan.token_ids.tolist()[:-1])
    with pytest.raises(InvalidRequestError):
        vllm_params.plan_from_params({"mpic": {"policy": "full"}}, [1, 2])


def test_cache_salt_separates_policies_and_plans() -> None:
    plan = _plan(False)
    salt = vllm_params.cache_salt(vllm_params.plan_to_params(plan, "mpic-4"))
    assert salt == vllm_params.cache_salt(vllm_params.plan_to_params(plan, "mpic-4"))
    assert salt != vllm_params.cache_salt(vllm_params.plan_to_params(plan, "mpic-8"))
    other = LinkPlan(**{**plan.__dict__, "entry_ids": ["c" * 64, "b" * 64]})
    assert salt != vllm_params.cache_salt(vllm_params.plan_to_params(other, "mpic-4"))


def test_collapse_placeholders_keeps_one_per_image() -> None:
    assert collapse_placeholders([1, 9, 9, 9, 2, 9, 9, 3, 9], 9) == [1, 9, 2, 9, 3, 9]
    assert collapse_placeholders([9, 9], 9) == [9]


def test_contiguous_runs() -> None:
    assert contiguous_runs(torch.tensor([0, 1, 2, 7, 8, 10])) == [(0, 3), (3, 5), (5, 6)]
    assert contiguous_runs(torch.tensor([], dtype=torch.int64)) == []


def test_config_enforces_cpu_block_size_and_no_extra_fields() -> None:
    assert VllmEngineConfig(model="m", block_size=64).block_size == 64
    with pytest.raises(ValidationError):
        VllmEngineConfig(model="m", block_size=16)
    with pytest.raises(ValidationError):
        VllmEngineConfig(model="m", blocksize=32)


def test_front_end_spells_out_the_models_scout_scales(tiny_llava_dir: Path, tmp_path) -> None:
    """A model folder with its own scout table (`calibrate-scout --write`): the vLLM front end
    names the policy with that table's S (and its scout layers and question weight), the S the
    reference runner takes from the same
    folder, so the connector's halves (which parse the name once more, in vLLM's processes)
    cannot fall back to the default table; without a table, the default table's canonical
    name."""
    import json
    import shutil

    from mpic.engine.hf.reference_runner import ReferenceRunner
    from mpic.engine.vllm.config import VllmEngineConfig
    from mpic.engine.vllm.frontend import VllmFrontEnd
    from mpic.linker.policies import get_policy
    from mpic.linker.policies.scout_scales import TABLE_FILE

    plain = VllmFrontEnd(VllmEngineConfig(model=str(tiny_llava_dir)))
    assert plain.scout_scales is None and plain.policy_name("auto") == get_policy("auto").name
    model = tmp_path / "model"
    shutil.copytree(tiny_llava_dir, model)
    scout = {"layers": [1], "question_weight": 0.5}  # the scout's fields (calibrate-scout)
    (model / TABLE_FILE).write_text(json.dumps({"table": [[0.1, 0.7], [0.3, 0.6]], "scout": scout}))
    front = VllmFrontEnd(VllmEngineConfig(model=str(model)))
    runner = ReferenceRunner(str(model))
    for name in ("auto", "scout-0.2", "auto-0.3", "mpic-32"):
        spelled = front.policy_name(name)
        assert spelled == get_policy(name, scales=runner.scout_scales).name
        assert get_policy(spelled).name == spelled  # parses to itself with the default table
    assert front.policy_name("auto") != get_policy("auto").name
    assert front.policy_name("auto").endswith(":l1-1:w0.5")  # the connector scores them too
    assert front.policy_name("scout-0.2:w0") == "scout-0.2:s0.65:l1-1:w0"  # spelled wins
    assert front.policy_name("mpic-32") == "mpic-32"
    # a policy parsed elsewhere (the Resolver's, default table) takes the model's table as
    # parsing its name here would: `with_scales`, no second parse
    for name in ("auto", "scout-0.2", "scout-0.2:k8", "scout-0.2:s0.5", "mpic-32"):
        parsed = get_policy(name).with_scales(front.scout_scales)
        assert parsed.name == front.policy_name(name)


def test_front_end_parses_a_name_once_and_takes_a_policy_as_given(
    tiny_llava_dir: Path, monkeypatch
) -> None:
    """`prepare` parses a policy name once (against the model's table) and sends its canonical
    name; a parsed policy (the Serve worker's, from the Resolver) is not parsed again."""
    from mpic.engine import request_flow
    from mpic.engine.vllm.config import VllmEngineConfig
    from mpic.engine.vllm.frontend import VllmFrontEnd
    from mpic.linker.policies import get_policy

    front = VllmFrontEnd(VllmEngineConfig(model=str(tiny_llava_dir)))
    parsed: list[str] = []

    def counting(name: str, *args, **kwargs):
        parsed.append(name)
        return get_policy(name, *args, **kwargs)

    monkeypatch.setattr(request_flow, "get_policy", counting)
    planned, request = front.prepare(["Say hello."], {}, "auto")
    assert parsed == ["auto"] and request.policy == get_policy("auto").name
    assert planned.policy.name == request.policy
    planned, request = front.prepare(["Say hello."], {}, get_policy("mpic-4"))
    assert parsed == ["auto"] and request.policy == "mpic-4" and planned.policy.name == "mpic-4"
    _, exact = front.prepare(["Say hello."], {}, "auto", exact=True)
    assert parsed == ["auto"] and exact.plan is None  # planned under `full`, no name parsed
