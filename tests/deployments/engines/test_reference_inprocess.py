"""The HTTP API on the REAL reference engine (tiny LLaVA), in-process (no Ray): a 3-turn chat
about two cached images answers exactly like the offline reference runner on the same
conversation and reports the images' linked tokens on every turn; seeded sampling, stop strings,
logprobs and logit_bias act on the real model; the multi-turn rendering equals the chat
template's own."""

from __future__ import annotations

import io
from pathlib import Path

import openai
import pytest
import torch

from tests.deployments.conftest import ADMIN_KEY, KEYS, png
from tests.deployments.inprocess import fake_config, in_process_app

POLICY = "mpic-4"
T = 16  # the tiny LLaVA's image tokens


@pytest.fixture(scope="module")
def app(tiny_llava_dir: Path, tmp_path_factory):
    cfg = fake_config(
        tmp_path_factory.mktemp("ref-store"), kind="reference", model=str(tiny_llava_dir)
    )
    with in_process_app(cfg, KEYS, [ADMIN_KEY]) as running:
        yield running


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(
        base_url=f"{app.url}/v1", api_key="alice-key", http_client=app.client, max_retries=0
    )


@pytest.fixture(scope="module")
def offline(tiny_llava_dir: Path):
    from mpic.engine.hf.reference_runner import ReferenceRunner

    return ReferenceRunner(str(tiny_llava_dir))


def _decode(runner, tokens: list[int]) -> str:
    return runner.processor.tokenizer.decode(tokens, skip_special_tokens=True)


def test_three_turn_chat_equals_offline_and_reuses_turn_one_images(client, offline) -> None:
    from mpic.prompt_parts import ImageRef, Turn

    media = [png(41), png(42)]
    fids = [
        client.files.create(file=(f"{i}.png", io.BytesIO(m), "image/png"), purpose="vision").id
        for i, m in enumerate(media)
    ]
    refs = [ImageRef(offline.cache_image(m).entry_id) for m in media]
    system = "You compare images."
    msgs: list[dict] = [
        {"role": "system", "content": system},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "first"},
                {"type": "file", "file": {"file_id": fids[0]}},
                {"type": "text", "text": "second"},
                {"type": "file", "file": {"file_id": fids[1]}},
                {"type": "text", "text": "differences?"},
            ],
        },
    ]
    parts: list = [Turn("user"), "first", refs[0], "second", refs[1], "differences?"]
    cached = []
    for turn, follow_up in enumerate(["which is brighter?", "and the first one?", None]):
        resp = client.chat.completions.create(
            model="mpic", messages=msgs, max_tokens=5, extra_body={"mpic": {"policy": POLICY}}
        )
        answer = resp.choices[0].message.content
        gen = offline.generate(parts if turn else parts[1:], POLICY, 5, system_prompt=system)
        assert answer == _decode(offline, gen.tokens), f"turn {turn + 1}"
        cached.append(resp.usage.prompt_tokens_details.cached_tokens)
        if follow_up is None:
            break
        msgs += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": follow_up},
        ]
        parts += [Turn("assistant"), answer, Turn("user"), follow_up]
    assert cached == [2 * (T - 4)] * 3  # both turn-1 images linked (T - k tokens each) per turn


def test_multi_turn_rendering_equals_the_chat_template(offline) -> None:
    from mpic.linker.prompt import render_prompt_ids
    from mpic.prompt_parts import ImageRef, Turn

    parts = [Turn("user"), "look", ImageRef("e"), Turn("assistant"), "a cat", Turn("user"), "why?"]
    ids = render_prompt_ids(offline.processor, parts, "sys")
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "sys"}]},
        {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a cat"}]},
        {"role": "user", "content": [{"type": "text", "text": "why?"}]},
    ]
    tok = offline.processor.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ids == tok(text)["input_ids"]


def test_sampling_fields_on_the_real_model(client, app, offline) -> None:
    from mpic.deployments.messages import Sampling
    from mpic.engine.sampling import Sampler

    msgs = [{"role": "user", "content": "tell me a story"}]

    def ask(**kw):
        kw.setdefault("max_tokens", 8)
        return client.chat.completions.create(
            model="mpic", messages=msgs, extra_body={"mpic": {"policy": "full"}}, **kw
        ).choices

    greedy = ask()[0].message.content
    gen = offline.generate(["tell me a story"], "full", 8)
    assert greedy == _decode(offline, gen.tokens)
    a, b = ask(temperature=1.0, seed=7), ask(temperature=1.0, seed=7)
    assert a[0].message.content == b[0].message.content != greedy
    tok = offline.processor.tokenizer
    sampler = Sampler(Sampling(temperature=1.0, seed=7), lambda i: tok.decode([i]))
    tokens = [t for t, _ in offline.stream(["tell me a story"], "full", 8, pick=sampler)]
    assert a[0].message.content == _decode(offline, tokens)  # the offline path, same seed
    cut = greedy[len(greedy) // 3 : len(greedy) // 3 + 2]
    if cut.strip():
        stopped = ask(stop=[cut])[0]
        assert stopped.message.content == greedy[: greedy.index(cut)]
        assert stopped.finish_reason == "stop"
    lp = ask(logprobs=True, top_logprobs=3, max_tokens=3)[0].logprobs.content
    assert len(lp) == 3 and all(t.top_logprobs[0].logprob == t.logprob for t in lp)
    first = offline.generate(["tell me a story"], "full", 1)
    token = first.tokens[0]
    logits = offline.prefill(["tell me a story"], "full", 1).logits
    assert lp[0].logprob == pytest.approx(
        float(torch.log_softmax(logits.float(), -1)[token]), abs=1e-4
    )
    banned = ask(logit_bias={str(token): -100}, max_tokens=1)[0].logprobs
    assert banned is None
    assert ask(logit_bias={str(token): -100}, max_tokens=1, logprobs=True)[0].logprobs.content[
        0
    ].token != tok.decode([token])
    assert len(ask(n=2, temperature=1.0, seed=1)) == 2


def test_exact_decode_answers_full_prefills_continuation(client, offline) -> None:
    """`mpic.exact_decode`: the first token is the policy's, the rest full prefill's after it
    (the offline runner's stream under `full` with that first pick forced); with a press: 400."""
    from mpic.prompt_parts import ImageRef

    media = [png(43), png(44)]
    fids = [
        client.files.create(file=(f"{i}.png", io.BytesIO(m), "image/png"), purpose="vision").id
        for i, m in enumerate(media)
    ]
    content = [{"type": "text", "text": "compare"}]
    parts: list = ["compare"]
    for fid, m in zip(fids, media, strict=True):
        content += [{"type": "file", "file": {"file_id": fid}}, {"type": "text", "text": "and"}]
        parts += [ImageRef(offline.cache_image(m).entry_id), "and"]
    msgs = [{"role": "user", "content": content}]
    resp = client.chat.completions.create(
        model="mpic",
        messages=msgs,
        max_tokens=8,
        extra_body={"mpic": {"policy": "auto", "exact_decode": True}, "ignore_eos": True},
    )
    first = offline.generate(parts, "auto", 1).tokens
    picks = list(first)

    def pick(logits):
        return picks.pop() if picks else int(logits.argmax())

    want = [t for t, _ in offline.stream(parts, "full", 8, pick=pick, stop_at_eos=False)]
    assert resp.choices[0].message.content == _decode(offline, want)
    assert resp.model_extra["mpic"]["exact_decode"] is True
    assert resp.usage.prompt_tokens_details.cached_tokens > 0  # the policy's pass linked them
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="mpic",
            messages=msgs,
            max_tokens=4,
            extra_body={"mpic": {"exact_decode": True, "press": "snapkv", "budget": 0.5}},
        )
    assert err.value.body["param"] == "mpic.exact_decode"
