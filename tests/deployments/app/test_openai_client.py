"""The official `openai` client works unchanged against a real local Ray Serve instance of the
application (the tiny LLaVA on the reference engine): models, files create/list/retrieve/content/
delete, chat completions (streaming and not) linking cached files, a 3-turn chat about turn 1's
images whose answers equal the offline reference runner's on the same conversation and report the
images' linked tokens on every turn, seeded sampling, stop strings, n, and the 400/404 answers."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from tests.deployments.conftest import ServeApp, png

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(serve_app: ServeApp):
    from openai import OpenAI

    return OpenAI(base_url=f"{serve_app.url}/v1", api_key="alice-key", max_retries=0, timeout=120)


def test_openai_files_and_chat(client) -> None:
    data = png(7)
    created = client.files.create(file=("cat.png", io.BytesIO(data), "image/png"), purpose="vision")
    assert created.id.startswith("file-") and created.bytes == len(data)
    assert created.model_extra["tokens"] == 16  # the tiny LLaVA's T
    assert created.purpose == "vision"
    assert created.id in [f.id for f in client.files.list()]
    assert client.files.retrieve(created.id).filename == "cat.png"
    short = client.files.create(
        file=("dog.png", io.BytesIO(png(8)), "image/png"),
        purpose="user_data",
        expires_after={"anchor": "created_at", "seconds": 3600},
    )
    assert short.expires_at - short.created_at == 3600
    assert short.purpose == "user_data"
    assert client.files.retrieve(short.id).purpose == "user_data"

    content = [
        {"type": "text", "text": "Describe"},
        {"type": "file", "file": {"file_id": created.id}},
        {"type": "text", "text": "in one word."},
    ]
    resp = client.chat.completions.create(
        model="mpic",
        messages=[{"role": "user", "content": content}],
        max_tokens=5,
        extra_body={"mpic": {"policy": "mpic-4"}},
    )
    answer = resp.choices[0].message.content
    assert resp.usage.completion_tokens == 5 and resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens_details.cached_tokens == 16 - 4  # T - k linked tokens
    assert resp.usage.prompt_tokens > 16

    stream = client.chat.completions.create(
        model="mpic",
        messages=[{"role": "user", "content": content}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"mpic": {"policy": "mpic-4"}},
    )
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == answer  # greedy: the stream spells the same answer
    assert usage.completion_tokens == 5 and finish == "length"
    assert usage.prompt_tokens_details.cached_tokens == 12

    deleted = client.files.delete(created.id)
    assert deleted.deleted and deleted.id == created.id
    assert created.id not in [f.id for f in client.files.list()]
    from openai import NotFoundError

    with pytest.raises(NotFoundError):
        client.files.retrieve(created.id)


POLICY = "mpic-4"
T = 16  # the tiny LLaVA's image tokens


@pytest.fixture(scope="module")
def offline(tiny_llava_dir: Path):
    """The offline engine on the same model folder (the oracle of every answer)."""
    from mpic.engine.hf.reference_runner import ReferenceRunner

    return ReferenceRunner(str(tiny_llava_dir))


def _decode(runner, tokens: list[int]) -> str:
    return runner.processor.tokenizer.decode(tokens, skip_special_tokens=True)


def _upload(client, seed: int) -> str:
    data = png(seed)
    return client.files.create(
        file=(f"{seed}.png", io.BytesIO(data), "image/png"), purpose="vision"
    ).id


def _file(fid: str) -> dict:
    return {"type": "file", "file": {"file_id": fid}}


def test_models_list_and_file_content(client, serve_app: ServeApp) -> None:
    assert [m.id for m in client.models.list().data] == [serve_app.config.engine.served_model_name]
    data = png(31)
    fid = client.files.create(file=("c.png", io.BytesIO(data), "image/png"), purpose="vision").id
    assert client.files.content(fid).read() == data


def test_three_turn_chat_reuses_turn_one_images_and_equals_offline(client, offline) -> None:
    from mpic.engine.request_flow import stored_linked_tokens
    from mpic.prompt_parts import ImageRef, Turn

    media = [png(32), png(33)]
    fids = [_upload(client, s) for s in (32, 33)]
    refs = [ImageRef(offline.cache_image(m).entry_id) for m in media]
    msgs: list[dict] = [
        {
            "role": "user",
            "content": [
                _file(fids[0]),
                _file(fids[1]),
                {"type": "text", "text": "what differs between these two?"},
            ],
        }
    ]
    parts: list = [Turn("user"), refs[0], refs[1], "what differs between these two?"]
    cached, prompt_tokens = [], []
    for turn, follow_up in enumerate(["which one is brighter?", "and the second one?", None]):
        resp = client.chat.completions.create(
            model="mpic", messages=msgs, max_tokens=6, extra_body={"mpic": {"policy": POLICY}}
        )
        answer = resp.choices[0].message.content
        gen = offline.generate(parts, POLICY, 6)
        assert answer == _decode(offline, gen.tokens), f"turn {turn + 1}"
        assert resp.usage.prompt_tokens == gen.prefilled.plan.num_tokens, f"turn {turn + 1}"
        assert resp.usage.completion_tokens == len(gen.tokens)
        linked = stored_linked_tokens(gen.prefilled.plan)  # both images, at this turn's positions
        assert resp.usage.prompt_tokens_details.cached_tokens == linked
        cached.append(resp.usage.prompt_tokens_details.cached_tokens)
        prompt_tokens.append(resp.usage.prompt_tokens)
        if follow_up is None:
            break
        msgs += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": follow_up},
        ]
        parts += [Turn("assistant"), answer, Turn("user"), follow_up]
    assert cached == [2 * (T - 4)] * 3  # T - k linked tokens per turn-1 image, on every turn
    assert prompt_tokens[0] < prompt_tokens[1] < prompt_tokens[2]  # images reused further back


def test_seed_stop_n_tools_and_unknown_model(client, offline) -> None:
    import openai

    from mpic.deployments.messages import Sampling
    from mpic.engine.sampling import Sampler
    from mpic.prompt_parts import ImageRef

    data = png(34)
    fid = _upload(client, 34)
    msgs = [{"role": "user", "content": [_file(fid), {"type": "text", "text": "tell a story"}]}]
    parts = [ImageRef(offline.cache_image(data).entry_id), "tell a story"]
    max_tokens = 16  # 16 sampled tokens of a random model: a collision with greedy is ~impossible

    def ask(**kw):
        kw.setdefault("max_tokens", max_tokens)
        return client.chat.completions.create(
            model="mpic", messages=msgs, extra_body={"mpic": {"policy": POLICY}}, **kw
        )

    def offline_sampled(seed: int) -> list[int]:
        tok = offline.processor.tokenizer
        sampler = Sampler(Sampling(temperature=1.0, seed=seed), lambda i: tok.decode([i]))
        return [t for t, _ in offline.stream(parts, POLICY, max_tokens, pick=sampler)]

    greedy = ask(temperature=0).choices[0].message.content
    assert greedy == _decode(offline, offline.generate(parts, POLICY, max_tokens).tokens)
    one, two = ask(temperature=1.0, seed=7), ask(temperature=1.0, seed=7)
    sampled = one.choices[0].message.content
    assert sampled == two.choices[0].message.content  # same seed, same text
    assert sampled != greedy
    assert sampled == _decode(
        offline, offline_sampled(7)
    )  # the offline runner with the same seeded sampler

    # stop: a piece from the middle of the greedy answer ends it there
    start = len(greedy) // 2
    cut = greedy[start : start + 3]
    assert cut.strip(), greedy
    stopped = ask(temperature=0, stop=[cut]).choices[0]
    assert cut not in stopped.message.content
    assert stopped.message.content == greedy[: greedy.index(cut)]
    assert stopped.finish_reason == "stop"

    # n=2: two choices; choice i samples with seed + i
    n2 = ask(n=2, temperature=1.0, seed=7)
    assert [c.index for c in n2.choices] == [0, 1]
    assert n2.choices[0].message.content == sampled
    seed8 = offline_sampled(8)
    assert n2.choices[1].message.content == _decode(offline, seed8)
    assert n2.choices[0].message.content != n2.choices[1].message.content
    assert n2.usage.completion_tokens == len(offline_sampled(7)) + len(seed8)

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as bad:
        ask(tools=[tool])
    assert bad.value.status_code == 400 and bad.value.param == "tools"
    assert "tools" in bad.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=msgs, max_tokens=2)
    assert missing.value.status_code == 404 and missing.value.code == "model_not_found"
