"""`mpic.recompute_budget` (fast, no Ray): validated at the edge (booleans, strings, out of range
rejected), and turned into the best selection for the budget (`auto-<b>` = `scout-<b>`) by the
resolver; beside another policy it is a 400."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from mpic.deployments.chat_request import ChatCompletionRequest
from mpic.deployments.config import ServeAppConfig
from mpic.deployments.serve.resolver import budgeted_policy
from mpic.errors import InvalidRequestError
from mpic.linker.policies import get_policy


def _request(mpic: dict) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "mpic": mpic}
    return ChatCompletionRequest.model_validate(body)


@pytest.mark.parametrize("value", [0.0, 0.2, 1.0, 1])
def test_budget_accepted(value) -> None:
    assert _request({"recompute_budget": value}).mpic.recompute_budget == value


@pytest.mark.parametrize("value", [True, False, "0.2", -0.1, 1.01, [0.2]])
def test_budget_rejected(value) -> None:
    with pytest.raises(ValidationError) as err:
        _request({"recompute_budget": value})
    assert "recompute_budget" in str(err.value)


def test_budget_to_policy() -> None:
    cfg = ServeAppConfig()
    assert budgeted_policy(None, 0.25, cfg) == "auto-0.25"
    assert budgeted_policy("auto", 0.25, cfg) == "auto-0.25"
    assert get_policy("auto-0.25").name == get_policy("scout-0.25").name
    assert budgeted_policy(None, None, cfg) == cfg.default_policy
    assert budgeted_policy("mpic-8", None, cfg) == "mpic-8"
    with pytest.raises(InvalidRequestError) as err:
        budgeted_policy("mpic-8", 0.2, cfg)
    assert err.value.param == "mpic.recompute_budget"
    with_default = ServeAppConfig.model_validate({"recompute_budget": 0.3})
    assert budgeted_policy("auto", None, with_default) == "auto-0.3"
