"""`logprobs.content[].bytes` are a token's own bytes (issue 25 item 4): a byte-level token that
holds one byte of a multi-byte character (the tiny Qwen2-VL tokenizer's id 130 is 0xBE) gives
[190], not U+FFFD's [239, 191, 189]; on the reference engine over HTTP (in-process) and on the
vLLM engine's conversion of vLLM's per-step logprobs (no vLLM run needed: the dicts are built
here with vLLM's own `Logprob`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deployments.conftest import ADMIN_KEY, KEYS
from tests.deployments.inprocess import fake_config, in_process_app

BYTE_TOKEN = 130
"""0xBE in the tiny Qwen2-VL tokenizer's byte-level vocabulary."""


@pytest.fixture(scope="module")
def qwen_tokenizer(tiny_qwen2vl_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen2vl_dir)


def test_token_bytes_match_the_vocabulary(qwen_tokenizer) -> None:
    from mpic.engine.token_bytes import TokenBytes

    tb = TokenBytes(qwen_tokenizer)
    assert tb.kind == "byte-level"
    assert qwen_tokenizer.convert_ids_to_tokens(BYTE_TOKEN) == "\u00be"
    assert tb(BYTE_TOKEN) == bytes([0xBE])
    assert qwen_tokenizer.decode([BYTE_TOKEN]) == "\ufffd"  # what the old answer encoded
    # every id: its bytes decode (with replacement) to the tokenizer's own text
    for i in range(len(qwen_tokenizer)):
        assert tb(i).decode("utf-8", "replace") == qwen_tokenizer.decode([i]), i
    # multi-byte characters split over byte tokens rebuild exactly from the bytes
    for text in ("é", "naïve café ¾", "日本語", "emoji 🙂"):
        ids = qwen_tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(tb(i) for i in ids) == text.encode("utf-8"), text


def test_sentencepiece_byte_fallback_and_text() -> None:
    from mpic.engine.token_bytes import TokenBytes

    class SP:  # a SentencePiece-style tokenizer (byte fallback pieces, ▁ for spaces)
        sp_model = object()
        all_special_ids = [0]
        pieces = {0: "</s>", 1: "<0xBE>", 2: "\u2581word", 3: "x"}

        def convert_ids_to_tokens(self, i):
            return self.pieces[i]

        def decode(self, ids):
            return {0: "</s>", 1: "\ufffd", 2: " word", 3: "x"}[ids[0]]

    tb = TokenBytes(SP())
    assert [tb(i) for i in range(4)] == [b"</s>", b"\xbe", b" word", b"x"]


def test_reference_engine_logprob_bytes_over_http(tiny_qwen2vl_dir: Path, tmp_path: Path) -> None:
    cfg = fake_config(tmp_path / "store", kind="reference", model=str(tiny_qwen2vl_dir))
    with in_process_app(cfg, KEYS, [ADMIN_KEY]) as app:
        body = {
            "model": "mpic",
            "max_tokens": 2,
            "logprobs": True,
            "top_logprobs": 3,
            "logit_bias": {str(BYTE_TOKEN): 100},  # the byte token is picked every step
            "messages": [{"role": "user", "content": "hi"}],
        }
        h = app.headers("alice-key")
        r = app.client.post("/v1/chat/completions", headers=h, json=body)
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert len(content) == 2
        for item in content:
            assert item["bytes"] == [190], item
            assert item["top_logprobs"][0]["bytes"] == [190]
            for alt in item["top_logprobs"]:
                assert bytes(alt["bytes"]).decode("utf-8", "replace") == alt["token"]
        # streaming: the same bytes per chunk
        with app.client.stream(
            "POST", "/v1/chat/completions", headers=h, json={**body, "stream": True}
        ) as s:
            import json

            chunks = [
                json.loads(line[6:])
                for line in s.iter_lines()
                if line.startswith("data: {") and '"logprobs"' in line
            ]
        got = [c["bytes"] for ch in chunks for c in ch["choices"][0]["logprobs"]["content"]]
        assert got == [[190], [190]]


def test_vllm_engine_logprob_bytes(qwen_tokenizer) -> None:
    pytest.importorskip("vllm")
    from vllm.logprobs import Logprob

    from mpic.engine.token_bytes import TokenBytes
    from mpic.engine.vllm.sampling import token_logprobs

    word = qwen_tokenizer.encode("the", add_special_tokens=False)[0]
    piece = qwen_tokenizer.decode([word]).encode()
    steps = [
        {
            BYTE_TOKEN: Logprob(-0.1, rank=1, decoded_token="\ufffd"),
            word: Logprob(-2.5, rank=2, decoded_token="the"),
        }
    ]
    raw = TokenBytes(qwen_tokenizer)  # what the vLLM Serve engine passes
    (item,) = token_logprobs(steps, [BYTE_TOKEN], 2, qwen_tokenizer.decode, raw)
    assert item.raw == bytes([0xBE]) and item.top_raw == [bytes([0xBE]), piece]
    from mpic.deployments.http.chat_routes import chat_logprobs

    (content,) = chat_logprobs([item]).content
    assert content.bytes == [190] and content.top_logprobs[1].bytes == list(piece)
