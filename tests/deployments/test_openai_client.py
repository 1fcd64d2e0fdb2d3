"""The official `openai` client works unchanged against a real local Ray Serve instance: files
create/list/retrieve/delete and chat completions (streaming and not) linking a cached file."""

from __future__ import annotations

import io

import pytest

from tests.deployments.conftest import ServeApp, png

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(serve_app: ServeApp):
    from openai import OpenAI

    return OpenAI(base_url=f"{serve_app.url}/v1", api_key="alice-key", max_retries=0)


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
