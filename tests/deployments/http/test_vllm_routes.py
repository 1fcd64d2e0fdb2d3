"""vLLM's non-chat routes (`mpic.deployments.http.vllm_routes`), in-process: `/v1/completions`
(OpenAI legacy shapes, streaming, usage, the official `openai` client), `/tokenize`,
`/detokenize`, `/health`, `/version`, `max_model_len` in `/v1/models`, the served-name check and
auth. The fake engine covers the shapes in milliseconds; the reference engine on the tiny LLaVA
checks token ids against the model's own tokenizer and a completion against transformers' greedy
generation of the template-free prompt. The vLLM-named metrics' aggregation over replicas is
checked on a synthetic Ray exposition."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import pytest

from tests.deployments.conftest import ADMIN_KEY, KEYS, png
from tests.deployments.inprocess import fake_config, in_process_app

ALICE = {"Authorization": "Bearer alice-key"}


def test_health_version_and_models(fake_app) -> None:
    health = fake_app.client.get("/health")  # no key, like vLLM's
    assert (health.status_code, health.content) == (200, b"")
    assert fake_app.client.get("/version").json() == {"version": version("mpic-serve")}
    models = fake_app.client.get("/v1/models", headers=ALICE).json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [("mpic", 4096)]
    one = fake_app.client.get("/v1/models/mpic", headers=ALICE).json()
    assert one["max_model_len"] == 4096 and one["root"] == "fake-model"
    assert fake_app.client.post("/tokenize", json={"prompt": "x"}).status_code == 401


def test_completions_shapes_and_openai_client(fake_app) -> None:
    from openai import NotFoundError, OpenAI

    client = OpenAI(
        base_url="http://testserver/v1", api_key="alice-key", http_client=fake_app.client
    )
    out = client.completions.create(model="mpic", prompt="red cat sits", max_tokens=8)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.choices[0].text == "red cat sits" and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == 4  # three words, then the fake EOS
    assert out.usage.total_tokens == out.usage.prompt_tokens + 4
    two = client.completions.create(
        model="mpic", prompt=["blue dog", "green image"], max_tokens=2, n=2, temperature=0
    )
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert [c.text for c in two.choices] == ["blue dog"] * 2 + ["green image"] * 2
    assert two.choices[0].finish_reason == "length"
    stream = client.completions.create(
        model="mpic",
        prompt="top left image",
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=2,
    )
    events = list(stream)
    text = "".join(e.choices[0].text for e in events if e.choices)
    assert text == "top left image"
    assert events[-1].usage.completion_tokens == 4 and not events[-1].choices
    with_lp = [e.choices[0].logprobs for e in events if e.choices and e.choices[0].text]
    assert all(len(lp.top_logprobs[0]) == 2 for lp in with_lp)
    with pytest.raises(NotFoundError):
        client.completions.create(model="other", prompt="x")


def test_completion_refusals(fake_app) -> None:
    def post(**body):
        return fake_app.client.post(
            "/v1/completions", headers=ALICE, json={"model": "mpic", **body}
        )

    assert post(prompt=[1, 2, 3]).json()["error"]["param"] == "prompt"
    assert post(prompt="x", echo=True).json()["error"]["param"] == "echo"
    assert post(prompt="x", suffix="y").status_code == 400
    # strictly typed, like chat bodies: no string for an int or a bool, no bool for an int
    for field, value in (("max_tokens", "4"), ("stream", "yes"), ("n", True), ("echo", 0)):
        bad = post(prompt="x", **{field: value})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == field, field
    assert post(prompt="x", max_tokens=2, temperature=0).status_code == 200  # int for a float
    up = fake_app.client.post(
        "/v1/files",
        headers=ALICE,
        files={"file": ("x.png", png(3), "image/png")},
        data={"purpose": "vision"},
    ).json()
    image = post(prompt="x", mpic={"files": [up["id"]]})
    assert image.status_code == 400 and "chat/completions" in image.json()["error"]["message"]


def test_tokenize_bytes_on_the_fake_engine(fake_app) -> None:
    got = fake_app.client.post("/tokenize", headers=ALICE, json={"prompt": "hé"}).json()
    assert got == {"count": 3, "max_model_len": 4096, "tokens": list("hé".encode())}
    back = fake_app.client.post("/detokenize", headers=ALICE, json={"tokens": got["tokens"]})
    assert back.json() == {"prompt": "hé"}


@pytest.fixture(scope="module")
def ref_app(tiny_llava_dir: Path, tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm-routes")
    cfg = fake_config(base / "store", kind="reference", model=str(tiny_llava_dir))
    with in_process_app(cfg, KEYS, [ADMIN_KEY]) as running:
        yield running


def test_tokenize_matches_the_model_tokenizer(ref_app, tiny_llava_dir: Path) -> None:
    from transformers import AutoTokenizer

    from mpic.linker.prompt import render_prompt_ids

    tok = AutoTokenizer.from_pretrained(tiny_llava_dir)
    text = "What is in the picture? A cat on a red mat."
    got = ref_app.client.post("/tokenize", headers=ALICE, json={"prompt": text}).json()
    assert got["tokens"] == tok(text)["input_ids"] and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == ref_app.worker.engine.runner.spec.max_model_len
    back = ref_app.client.post("/detokenize", headers=ALICE, json={"tokens": got["tokens"]})
    assert back.json()["prompt"] == tok.decode(got["tokens"])
    bad = ref_app.client.post("/detokenize", headers=ALICE, json={"tokens": [len(tok) + 5]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    chat = ref_app.client.post(
        "/tokenize", headers=ALICE, json={"messages": [{"role": "user", "content": text}]}
    ).json()
    assert chat["tokens"] == render_prompt_ids(tok, [text], None)
    answer = ref_app.client.post(
        "/v1/chat/completions",
        headers=ALICE,
        json={"model": "mpic", "max_tokens": 1, "messages": [{"role": "user", "content": text}]},
    ).json()
    assert answer["usage"]["prompt_tokens"] == chat["count"]  # what a text chat is charged


@pytest.mark.parametrize(
    ("messages", "fields"),
    [
        ([{"role": "user", "content": "a cat"}], {"add_generation_prompt": False}),
        (
            [{"role": "user", "content": "a cat"}, {"role": "assistant", "content": "It is"}],
            {"add_generation_prompt": False, "continue_final_message": True},
        ),
    ],
)
def test_tokenize_takes_the_chat_template_fields(ref_app, tiny_llava_dir, messages, fields):
    """`/tokenize` renders chat messages with vLLM's template fields as the chat route does:
    the ids are HF's own rendering of them, and what that chat is charged."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llava_dir)
    got = ref_app.client.post("/tokenize", headers=ALICE, json={"messages": messages, **fields})
    assert got.status_code == 200, got.text
    hf = tok.apply_chat_template(messages, tokenize=True, **fields)
    hf = hf["input_ids"] if isinstance(hf, dict) or hasattr(hf, "keys") else hf
    default = ref_app.client.post("/tokenize", headers=ALICE, json={"messages": messages})
    assert got.json()["tokens"] == list(hf) != default.json()["tokens"]
    answer = ref_app.client.post(
        "/v1/chat/completions",
        headers=ALICE,
        json={"model": "mpic", "max_tokens": 1, "messages": messages, **fields},
    ).json()
    assert answer["usage"]["prompt_tokens"] == got.json()["count"]
    bad = ref_app.client.post(
        "/tokenize",
        headers=ALICE,
        json={"messages": messages[:1], "add_generation_prompt": False,
              "continue_final_message": True},
    )  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message"


def test_completion_is_greedy_generation_of_the_raw_prompt(ref_app, tiny_llava_dir) -> None:
    import torch
    from transformers import AutoTokenizer

    from mpic.engine.hf.loader import load_hf_model

    text = "Once upon a time"
    tok = AutoTokenizer.from_pretrained(tiny_llava_dir)
    model, _, _ = load_hf_model(tiny_llava_dir)
    ids = torch.tensor([tok(text)["input_ids"]])
    generated = []
    with torch.no_grad():
        for _ in range(6):
            logits = model(input_ids=torch.cat([ids, torch.tensor([generated])], 1).long()
                           if generated else ids).logits  # fmt: skip
            generated.append(int(logits[0, -1].argmax()))
    resp = ref_app.client.post(
        "/v1/completions",
        headers=ALICE,
        json={"model": "mpic", "prompt": text, "max_tokens": 6, "ignore_eos": True},
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["usage"]["prompt_tokens"] == ids.shape[1]  # no chat template around it
    assert body["choices"][0]["text"] == tok.decode(generated, skip_special_tokens=True)


def test_vllm_metrics_are_summed_over_replicas() -> None:
    from mpic.deployments.monitoring.vllm_metrics import render_vllm_metrics

    ttft = "ray_vllm_time_to_first_token_seconds"
    ray_text = "\n".join(
        [
            "# TYPE ray_vllm_prompt_tokens_total counter",
            'ray_vllm_prompt_tokens_total{ReplicaId="a",model_name="qwen",replica="a"} 5.0',
            'ray_vllm_prompt_tokens_total{ReplicaId="b",model_name="qwen",replica="b"} 7.0',
            "# TYPE ray_vllm_time_to_first_token_seconds histogram",
            'ray_vllm_time_to_first_token_seconds_bucket{le="0.1",model_name="qwen",replica="a"} 1',
            'ray_vllm_time_to_first_token_seconds_bucket{le="0.1",model_name="qwen",replica="b"} 2',
            ttft + '_bucket{le="+Inf",model_name="qwen",replica="a"} 2',
            ttft + '_bucket{le="+Inf",model_name="qwen",replica="b"} 3',
            'ray_vllm_time_to_first_token_seconds_sum{model_name="qwen",replica="a"} 0.5',
            'ray_vllm_time_to_first_token_seconds_sum{model_name="qwen",replica="b"} 0.25',
            'ray_vllm_time_to_first_token_seconds_count{model_name="qwen",replica="a"} 2',
            'ray_vllm_time_to_first_token_seconds_count{model_name="qwen",replica="b"} 3',
            "# TYPE ray_vllm_num_requests_running gauge",
            'ray_vllm_num_requests_running{model_name="qwen",replica="w1"} 2',
            'ray_vllm_num_requests_running{model_name="qwen",replica="w2"} 1',
            "# TYPE ray_mpic_requests_in_flight gauge",
            'ray_mpic_requests_in_flight{replica="i1"} 4',
            'ray_mpic_requests_in_flight{replica="i2"} 1',
        ]
    )
    out = render_vllm_metrics(ray_text, "qwen")
    from prometheus_client.parser import text_string_to_metric_families

    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(out)
        for s in f.samples
    }
    q = (("model_name", "qwen"),)
    assert got[("vllm:prompt_tokens_total", q)] == 12
    assert got[("vllm:time_to_first_token_seconds_bucket", (("le", "0.1"), *q))] == 3
    assert got[("vllm:time_to_first_token_seconds_bucket", (("le", "+Inf"), *q))] == 5
    assert got[("vllm:time_to_first_token_seconds_count", q)] == 5
    assert got[("vllm:time_to_first_token_seconds_sum", q)] == 0.75
    assert got[("vllm:num_requests_running", q)] == 3
    assert got[("vllm:num_requests_waiting", q)] == 2  # 5 accepted - 3 running
    assert not any("replica" in dict(k[1]) for k in got)
