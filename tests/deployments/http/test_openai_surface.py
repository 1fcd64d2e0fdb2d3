"""The OpenAI surface on the in-process application with the fake engine (no Ray, no model;
seconds): the official `openai` client unchanged (models, files, content, chat), every chat field
honoured or rejected with a 400 naming it, multi-turn chats reporting the cached tokens of earlier
turns' images, SSE errors after the stream started, expiry updates, the sweeper, lost files."""

from __future__ import annotations

import io
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from mpic.deployments.engines.fake_engine import FakeServeEngine, fake_tokens
from mpic.deployments.messages import TokenEvent
from tests.deployments.conftest import ADMIN_KEY, KEYS, png
from tests.deployments.inprocess import fake_config, in_process_app


@pytest.fixture
def client(fake_app):
    return openai.OpenAI(
        base_url=f"{fake_app.url}/v1",
        api_key="alice-key",
        http_client=fake_app.client,
        max_retries=0,
    )


def _upload(client, seed: int, **kw):
    return client.files.create(
        file=(f"{seed}.png", io.BytesIO(png(seed)), "image/png"), purpose="vision", **kw
    )


def _user(fid: str, text: str) -> dict:
    return {
        "role": "user",
        "content": [{"type": "file", "file": {"file_id": fid}}, {"type": "text", "text": text}],
    }


def _err(resp, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    return err


def test_models_and_unknown_model(client, fake_app) -> None:
    assert [m.id for m in client.models.list().data] == ["mpic"]
    assert client.models.retrieve("mpic").id == "mpic"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.body["code"] == "model_not_found"


def test_files_content_pagination_and_expiry_update(client, fake_app) -> None:
    a, b = _upload(client, 1), _upload(client, 2)
    c = client.files.create(file=("c.png", io.BytesIO(png(3)), "image/png"), purpose="user_data")
    assert client.files.content(a.id).content == png(1)
    page = client.files.list(limit=2)  # newest first, as OpenAI's default order
    assert [f.id for f in page.data] == [c.id, b.id] and page.has_more
    assert [f.id for f in client.files.list(limit=2, after=b.id).data] == [a.id]
    page = client.files.list(limit=2, order="asc")
    assert [f.id for f in page.data] == [a.id, b.id] and page.has_more
    assert [f.id for f in client.files.list(limit=2, after=b.id, order="asc").data] == [c.id]
    assert [f.id for f in client.files.list(purpose="user_data").data] == [c.id]
    assert [f.id for f in client.files.list()] == [c.id, b.id, a.id]  # auto-paging iterator
    h = fake_app.headers("alice-key")
    http = fake_app.client
    _err(http.get("/v1/files", params={"after": "file-nope"}, headers=h), 400, "after")
    _err(http.get("/v1/files", params={"limit": 0}, headers=h), 400, "limit")
    # expiry update (POST on the file, Gemini cachedContents-style)
    r = http.post(f"/v1/files/{a.id}", json={"ttl_seconds": 120}, headers=h)
    assert r.status_code == 200, r.text
    assert abs(r.json()["expires_at"] - (time.time() + 120)) <= 2
    r = http.post(
        f"/v1/files/{a.id}",
        json={"expires_after": {"anchor": "created_at", "seconds": 60}},
        headers=h,
    )
    assert r.json()["expires_at"] == a.created_at + 60
    assert client.files.retrieve(a.id).expires_at == a.created_at + 60
    _err(http.post(f"/v1/files/{a.id}", json={"ttl_seconds": 10**9}, headers=h), 400, "ttl")
    _err(http.post(f"/v1/files/{a.id}", json={}, headers=h), 400)
    bob = fake_app.headers("bob-key")
    _err(http.post(f"/v1/files/{a.id}", json={"ttl_seconds": 60}, headers=bob), 404)
    _err(http.get(f"/v1/files/{a.id}/content", headers=bob), 404)


def test_seed_stop_n_logprobs(client) -> None:
    fid = _upload(client, 4).id
    msgs = [_user(fid, "the red cat sat on the blue mat today")]

    def ask(**kw):
        kw.setdefault("max_tokens", 8)
        return client.chat.completions.create(model="mpic", messages=msgs, **kw)

    greedy = ask().choices[0].message.content
    assert greedy == "the red cat sat on the blue mat"  # the fake engine's echo
    one, two = ask(temperature=1.0, seed=7), ask(temperature=1.0, seed=7)
    assert one.choices[0].message.content == two.choices[0].message.content
    assert one.choices[0].message.content != greedy
    assert ask(temperature=1.0, seed=8).choices[0].message.content != one.choices[0].message.content
    stopped = ask(stop=["sat"]).choices[0]
    assert stopped.message.content == "the red cat " and stopped.finish_reason == "stop"
    assert ask(stop="blue").choices[0].message.content == "the red cat sat on the "
    n2 = ask(n=2, temperature=1.0, seed=3)
    assert [c.index for c in n2.choices] == [0, 1]
    assert n2.choices[0].message.content != n2.choices[1].message.content
    assert n2.usage.completion_tokens == sum(
        len(c.message.content.split()) + (c.finish_reason == "stop") for c in n2.choices
    )
    lp = ask(logprobs=True, top_logprobs=2, max_tokens=3).choices[0].logprobs.content
    assert [t.token for t in lp] == ["the", "red", "cat"]
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lp)
    assert lp[0].top_logprobs[0].token == "the"  # greedy picks the most likely token
    # top_p tiny: the nucleus is the single most likely token, so sampling is greedy
    assert ask(temperature=1.0, top_p=1e-6, seed=1).choices[0].message.content == greedy
    # penalties (2 + 2 for a repeat) outweigh the fake echo's preference (3): "the" is said once
    pen = ask(frequency_penalty=2.0, presence_penalty=2.0).choices[0].message.content
    assert pen.split().count("the") == 1 and pen.startswith("the red cat sat on")
    assert ask(frequency_penalty=2.0).choices[0].message.content == greedy  # 3 - 2 still wins


def test_vllm_sampling_extensions(client, fake_app) -> None:
    # vLLM's `extra_body` sampling fields, honoured (the fake engine's Sampler is the reference
    # engine's; both engines' greedy answers under them: tests/deployments/engines)
    h, http = fake_app.headers("alice-key"), fake_app.client
    fid = _upload(client, 4).id
    msgs = [_user(fid, "the red cat sat on the blue mat today")]

    def ask(**kw):
        kw.setdefault("max_tokens", 8)
        return client.chat.completions.create(model="mpic", messages=msgs, **kw).choices[0]

    greedy = ask().message.content
    for only_the_likeliest in ({"top_k": 1}, {"min_p": 1.0}):
        sampled = ask(temperature=1.0, seed=5, extra_body=only_the_likeliest)
        assert sampled.message.content == greedy, only_the_likeliest
    assert ask(temperature=1.0, seed=5).message.content != greedy
    ended = ask(max_tokens=16)
    assert ended.finish_reason == "stop" and len(ended.message.content.split()) == 9
    held = ask(max_tokens=16, extra_body={"min_tokens": 12})
    assert len(held.message.content.split()) >= 12  # no end token before 12
    assert held.message.content.startswith(ended.message.content)
    penalised = ask(extra_body={"repetition_penalty": 5.0}).message.content
    assert penalised != greedy  # the prompt's words lost their lead
    sat = fake_app.worker.engine.backend.tokenizer.id_of("sat")  # the echo's word ids
    cut = client.chat.completions.create(
        model="mpic", messages=msgs, max_tokens=8, extra_body={"stop_token_ids": [sat]}
    )
    assert cut.choices[0].message.content == "the red cat"  # "sat" ends it, unsaid
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == 4
    kept = ask(extra_body={"stop_token_ids": [sat], "include_stop_str_in_output": True})
    assert kept.message.content == "the red cat sat"
    assert ask(stop=["cat"], extra_body={"include_stop_str_in_output": True}).message.content == (
        "the red cat"
    )
    held = ask(max_tokens=16, extra_body={"stop_token_ids": [sat], "min_tokens": 5})
    assert "sat" not in held.message.content.split()[:4]  # held back for the first 5 tokens
    body = {"model": "mpic", "messages": msgs, "stop_token_ids": [-1]}
    _err(http.post("/v1/chat/completions", json=body, headers=h), 400, "stop_token_ids.0")
    body = {"model": "mpic", "messages": msgs, "max_tokens": 4, "min_tokens": 5}
    _err(http.post("/v1/chat/completions", json=body, headers=h), 400, "min_tokens")
    body = {"model": "mpic", "messages": msgs, "min_tokens": 4000}  # over the server's default
    _err(http.post("/v1/chat/completions", json=body, headers=h), 400, "min_tokens")
    body = {"model": "mpic", "prompt": "a b", "max_tokens": 2, "min_tokens": 3}
    _err(http.post("/v1/completions", json=body, headers=h), 400, "min_tokens")
    body = {"model": "mpic", "prompt": "a b c", "max_tokens": 3, "top_k": 1, "temperature": 1}
    out = http.post("/v1/completions", json=body, headers=h)
    assert out.status_code == 200, out.text


def test_special_token_fields(client, fake_app) -> None:
    # vLLM's `skip_special_tokens` and `spaces_between_special_tokens` (the fake engine's end
    # token `<eos>` is its special token): said when not skipped, the ending one only with
    # `include_stop_str_in_output` (vLLM's rule), on chat and completions
    h, http = fake_app.headers("alice-key"), fake_app.client
    msgs = [_user(_upload(client, 4).id, "the red cat sat")]

    def ask(**body) -> str:
        out = client.chat.completions.create(
            model="mpic", messages=msgs, max_tokens=6, extra_body=body
        )
        return out.choices[0].message.content

    assert ask() == ask(skip_special_tokens=False) == ask(ignore_eos=True) == "the red cat sat"
    assert ask(ignore_eos=True, skip_special_tokens=False) == "the red cat sat <eos> <eos>"
    kept = {"include_stop_str_in_output": True}
    assert ask(**kept) == "the red cat sat"
    assert ask(**kept, skip_special_tokens=False) == "the red cat sat <eos>"
    glued = ask(**kept, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert glued == "the red cat sat<eos>"
    assert ask(**kept, spaces_between_special_tokens=False) == "the red cat sat"
    body = {"model": "mpic", "prompt": "red cat", "max_tokens": 4, "ignore_eos": True}
    out = http.post("/v1/completions", json={**body, "skip_special_tokens": False}, headers=h)
    assert out.status_code == 200 and out.json()["choices"][0]["text"] == "red cat <eos> <eos>"
    for field, value in (("skip_special_tokens", "no"), ("spaces_between_special_tokens", 1)):
        bad = {"model": "mpic", "messages": msgs, field: value}
        _err(http.post("/v1/chat/completions", json=bad, headers=h), 400, field)
    bad = {**body, "skip_special_tokens": "maybe"}
    _err(http.post("/v1/completions", json=bad, headers=h), 400, "skip_special_tokens")


@pytest.mark.parametrize(
    "field,value",
    [
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("tool_choice", "auto"),
        ("response_format", {"type": "json_object"}),
        ("functions", [{"name": "f"}]),
        ("audio", {"voice": "alloy", "format": "mp3"}),
        ("modalities", ["text", "audio"]),
        ("store", True),
        ("reasoning_effort", "low"),
        ("prediction", {"type": "content", "content": "x"}),
        ("metadata", {"a": "b"}),
        ("temperature", 3),
        ("top_p", 0),
        ("n", 9),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("top_logprobs", 2),
        ("stop", ["a", "b", "c", "d", "e"]),
        ("logit_bias", {"abc": 1}),
        ("logit_bias", {"5": 500}),
        ("max_tokens", 0),
        ("seed", 2**70),
        ("not_an_openai_field", 1),
        ("service_tier", "flex"),
        ("top_k", -2),
        ("top_k", 1.5),
        ("min_p", 1.5),
        ("repetition_penalty", 0),
        ("min_tokens", -1),
    ],
)
def test_unsupported_or_bad_fields_are_400_naming_the_field(fake_app, field, value) -> None:
    body = {"model": "mpic", "messages": [{"role": "user", "content": "hi"}], field: value}
    err = _err(
        fake_app.client.post(
            "/v1/chat/completions", json=body, headers=fake_app.headers("alice-key")
        ),
        400,
    )
    assert err["param"].split(".")[0] == field, err


def test_bad_policy_and_logit_bias_are_400(fake_app) -> None:
    h, http = fake_app.headers("alice-key"), fake_app.client
    msgs = [{"role": "user", "content": "hi"}]
    for policy in ("mpic-99999999999999999999999", "mpic--1", "nope"):
        body = {"model": "mpic", "messages": msgs, "mpic": {"policy": policy}}
        _err(http.post("/v1/chat/completions", json=body, headers=h), 400, "mpic.policy")
    body = {"model": "mpic", "messages": msgs, "logit_bias": {"99999": 5}}
    _err(http.post("/v1/chat/completions", json=body, headers=h), 400, "logit_bias")
    body = {"model": "mpic", "messages": [{"role": "tool", "content": "x"}]}
    _err(http.post("/v1/chat/completions", json=body, headers=h), 400, "messages.0.role")


def test_accepted_no_op_values(client) -> None:
    out = client.chat.completions.create(
        model="mpic",
        messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": "a b"}],
        response_format={"type": "text"},
        modalities=["text"],
        store=False,
        user="end-user-1",
        service_tier="auto",
        max_completion_tokens=4,
    )
    assert out.choices[0].message.content == "a b"


def test_three_turn_chat_reports_cached_tokens_of_turn_one_images(client) -> None:
    f1, f2 = _upload(client, 5), _upload(client, 6)
    t1, t2 = fake_tokens(png(5)), fake_tokens(png(6))
    msgs: list[dict] = [{"role": "system", "content": "You describe images."}]
    msgs.append(
        {
            "role": "user",
            "content": [
                {"type": "file", "file": {"file_id": f1.id}},
                {"type": "file", "file": {"file_id": f2.id}},
                {"type": "text", "text": "compare them"},
            ],
        }
    )
    cached = []
    for question in ("which is red", "and the left one"):
        resp = client.chat.completions.create(model="mpic", messages=msgs, max_tokens=6)
        cached.append(resp.usage.prompt_tokens_details.cached_tokens)
        msgs.append({"role": "assistant", "content": resp.choices[0].message.content})
        msgs.append({"role": "user", "content": question})
    resp = client.chat.completions.create(model="mpic", messages=msgs, max_tokens=6)
    cached.append(resp.usage.prompt_tokens_details.cached_tokens)
    assert cached == [t1 + t2] * 3  # both images of turn 1 are reused by every later turn
    assert resp.choices[0].message.content == "and the left one"


class FailingEngine(FakeServeEngine):
    """Fails after its second token (an error after the stream started)."""

    async def generate(self, prompt, entries) -> AsyncIterator:
        n = 0
        async for ev in super().generate(prompt, entries):
            if isinstance(ev, TokenEvent):
                n += 1
                if n > 2:
                    raise RuntimeError("engine crashed")
            yield ev


def test_error_after_stream_start_is_an_sse_error_event(tmp_path: Path) -> None:
    kind = "tests.deployments.http.test_openai_surface:FailingEngine"
    with in_process_app(fake_config(tmp_path, kind=kind), KEYS, [ADMIN_KEY]) as app:
        body = {
            "model": "mpic",
            "stream": True,
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "one two three four five"}],
        }
        r = app.client.post("/v1/chat/completions", json=body, headers=app.headers("alice-key"))
        assert r.status_code == 200
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and "RuntimeError" in error["message"]
        texts = [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-2]]
        assert "".join(texts) == "one two"
        # the official client raises on the error event
        client = openai.OpenAI(
            base_url=f"{app.url}/v1", api_key="alice-key", http_client=app.client, max_retries=0
        )
        with pytest.raises(openai.APIError):
            for _ in client.chat.completions.create(**body):
                pass


def test_stream_usage_and_logprobs(client) -> None:
    chunks = list(
        client.chat.completions.create(
            model="mpic",
            messages=[{"role": "user", "content": "red blue green"}],
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "red blue green"
    tokens = [
        t.token
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert tokens == ["red", "blue", "green"]
    assert chunks[-1].usage.completion_tokens == 4  # three words and EOS


def _store_path(app, key: str) -> Path:
    return Path(app.config.store.url.removeprefix("file://")) / key


def test_sweeper_deletes_expired_bytes_and_keeps_a_file_in_use(tmp_path: Path) -> None:
    from mpic.storage.entry_store import entry_object_key
    from mpic.storage.static_library import media_key

    cfg = fake_config(tmp_path)
    cfg = cfg.model_copy(
        update={"store": cfg.store.model_copy(update={"sweep_grace_s": 0}), "sweep_interval_s": 0}
    )
    with in_process_app(cfg, KEYS, [ADMIN_KEY]) as app:
        http = app.client
        alice, bob = app.headers("alice-key"), app.headers("bob-key")

        def up(h, seed, ttl):
            files = {"file": ("x.png", png(seed), "image/png")}
            data = {"purpose": "vision", "ttl_seconds": str(ttl)}
            return http.post("/v1/files", headers=h, files=files, data=data).json()

        gone, kept = up(alice, 20, 1), up(alice, 21, 1)
        shared = up(bob, 21, 3600)  # the same image as `kept`, still live for bob
        lib = app.worker.library
        recs = {f["id"]: lib._load(u, f["id"]) for u, f in (("alice", gone), ("alice", kept))}
        blobs = {
            fid: [media_key(r.content_hash), entry_object_key(r.entry_key)]
            for fid, r in recs.items()
        }
        for keys in blobs.values():
            assert all(_store_path(app, k).exists() for k in keys)
        time.sleep(1.2)
        _err(http.post("/v1/admin/sweep", headers=alice), 403)
        report = http.post("/v1/admin/sweep", headers=app.headers(ADMIN_KEY)).json()
        assert sorted(report["expired"]) == sorted([gone["id"], kept["id"]])
        assert not any(_store_path(app, k).exists() for k in blobs[gone["id"]])
        assert all(_store_path(app, k).exists() for k in blobs[kept["id"]])  # bob's is live
        assert recs[gone["id"]].entry_key not in app.worker.entries.memory
        _err(http.get(f"/v1/files/{gone['id']}", headers=alice), 410)
        assert [f["id"] for f in http.get("/v1/files", headers=alice).json()["data"]] == []
        chat = {"model": "mpic", "messages": [_user(shared["id"], "red")]}
        r = http.post("/v1/chat/completions", json=chat, headers=bob)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_lost_file_is_410_and_marked_lost(fake_app, caplog) -> None:
    from mpic.storage.entry_store import entry_object_key
    from mpic.storage.static_library import media_key

    http, h = fake_app.client, fake_app.headers("alice-key")
    files = {"file": ("x.png", png(30), "image/png")}
    f = http.post("/v1/files", headers=h, files=files, data={"purpose": "vision"}).json()
    rec = fake_app.worker.library._load("alice", f["id"])
    chat = {"model": "mpic", "messages": [_user(f["id"], "red")]}
    # entry lost, media kept: a fallback (recomputed), logged as a WARNING with both ids
    fake_app.worker.entries.delete(rec.entry_key)
    with caplog.at_level("WARNING"):
        r = http.post("/v1/chat/completions", json=chat, headers={**h, "X-Request-ID": "rid-42"})
    assert r.status_code == 200, r.text
    assert r.json()["mpic"]["fallbacks"] == 1 and r.headers["x-request-id"] == "rid-42"
    warned = [m for m in caplog.records if m.levelname == "WARNING" and "rid-42" in m.getMessage()]
    assert warned and f["id"] in warned[0].getMessage()
    # entry and media both gone: 410 with a clear message, "lost" in retrieve and list
    fake_app.worker.entries.delete(rec.entry_key)
    fake_app.worker.entries.objects.delete(media_key(rec.content_hash))
    assert not fake_app.worker.entries.objects.exists(entry_object_key(rec.entry_key))
    err = _err(http.post("/v1/chat/completions", json=chat, headers=h), 410, "file_id")
    assert err["code"] == "file_lost" and "upload the image again" in err["message"]
    got = http.get(f"/v1/files/{f['id']}", headers=h).json()
    assert got["status"] == "lost" and "lost" in got["status_details"]
    assert http.get("/v1/files", headers=h).json()["data"][0]["status"] == "lost"
    _err(http.get(f"/v1/files/{f['id']}/content", headers=h), 410)


def test_several_choices_stream_as_they_come(client, fake_app) -> None:
    # n > 1 streamed (as vLLM streams it): every choice's chunks name its index, each choice
    # ends with its finish chunk, and the one usage chunk counts them all; the same texts as
    # the whole answer with the same seed
    fid = _upload(client, 4).id
    msgs = [_user(fid, "the red cat sat on the blue mat today")]
    kw = {"model": "mpic", "messages": msgs, "n": 3, "max_tokens": 6, "temperature": 1.0}
    whole = client.chat.completions.create(**kw, seed=11)
    texts, finish, usage = ["", "", ""], {}, None
    for c in client.chat.completions.create(
        **kw, seed=11, stream=True, stream_options={"include_usage": True}
    ):
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
        usage = c.usage or usage
    assert texts == [c.message.content for c in whole.choices]
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    # legacy completions: two prompts x n=2 streamed, choice k from prompt k // 2
    body = {"model": "mpic", "prompt": ["a b c", "d e f"], "n": 2, "max_tokens": 4, "seed": 3}
    h = fake_app.headers("alice-key")
    want = fake_app.client.post("/v1/completions", json=body, headers=h).json()
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    got, last = ["", "", "", ""], None
    with fake_app.client.stream("POST", "/v1/completions", json=body, headers=h) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                for choice in event["choices"]:
                    got[choice["index"]] += choice["text"]
                last = event.get("usage") or last
    assert got == [c["text"] for c in want["choices"]]
    assert got[0] and got[2] and got[0] != got[2]  # the second prompt is answered too
    assert last == want["usage"]


def test_an_upload_of_the_wrong_kind_says_what_its_purpose_takes(fake_app) -> None:
    h, http = fake_app.headers("alice-key"), fake_app.client

    def upload(name: str, data: bytes, purpose: str, content_type: str = "application/pdf"):
        files = {"file": (name, data, content_type)}
        return http.post("/v1/files", files=files, data={"purpose": purpose}, headers=h)

    err = _err(upload("paper.pdf", b"%PDF-1.4 text", "user_data"), 415, "file")
    assert "paper.pdf (application/pdf) is neither a text document" in err["message"]
    err = _err(upload("notes.txt", b"plain words", "vision", "text/plain"), 415, "file")
    assert "is not an image; a text document is uploaded with purpose user_data" in err["message"]
    err = _err(upload("notes.txt", b"plain words", "fine-tune", "text/plain"), 400, "purpose")
    assert "'vision' or 'user_data'" in err["message"]
    assert http.get("/v1/files", headers=h).json()["data"] == []  # nothing was kept
