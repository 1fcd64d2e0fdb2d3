"""Streamed text (`mpic.engine.detokenize.Detokenizer`, LLM-worker replicas): pieces pushed
one token or several at a time join to the decoded text under the request's decode options
(`skip_special_tokens`, `spaces_between_special_tokens`), with the project's byte-level
tokenizers and a Llama-style one (its decoder strips a leading space); a piece never ends in
an incomplete character (U+FFFD) while more tokens may complete it, and a push decodes a few
tokens only, however long the answer (constant work per token)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from mpic.deployments.engines.fake_engine import FakeTokenizer
from mpic.engine.detokenize import Detokenizer, token_events

CHARS = ["a", "b", "c", " ", "  ", ",", ".", "\n", "é", "ü", "東京", "😀", "🚀", "👩‍👩‍👧", "﷽"]
"""Text to encode: multi-byte characters, emoji split across byte tokens, runs of spaces."""


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(params=["smollm2_dir", "tiny_llava_dir", "tiny_qwen2vl_dir"])
def tokenizer(request: pytest.FixtureRequest):
    """The project's tokenizers: the trained SmolLM2's and the tiny models' byte-level BPEs."""
    return _tokenizer(request.getfixturevalue(request.param))


def _streamed(detok: Detokenizer, ids: list[int], rng: random.Random) -> tuple[str, int]:
    """(the pieces of `ids` pushed in uneven chunks, as vLLM emits them under load, and the
    flushed rest, joined; how many chunks were held back whole)."""
    pieces, held, i = [], 0, 0
    while i < len(ids):
        step = rng.randint(1, 3)
        piece = detok.push(ids[i : i + step]).text
        assert not piece.endswith("\ufffd")
        held += piece == ""
        pieces.append(piece)
        i += step
    return "".join(pieces) + detok.flush().text, held


def _sequence(tok, rng: random.Random, kind: int) -> list[int]:
    """Random ids (0), or random text encoded (1), with special tokens between its tokens (2)."""
    if kind == 0:
        return [rng.randrange(len(tok)) for _ in range(rng.randint(1, 32))]
    text = "".join(rng.choice(CHARS) for _ in range(rng.randint(1, 24)))
    ids = tok.encode(text, add_special_tokens=False)
    specials = sorted(tok.added_tokens_decoder)
    for _ in range(rng.randint(1, 4) if kind == 2 else 0):
        ids.insert(rng.randint(0, len(ids)), rng.choice(specials))
    return ids


def test_pieces_join_to_the_decoded_text(tokenizer) -> None:
    rng = random.Random(0)
    held = said = 0
    for n in range(240):
        ids = _sequence(tokenizer, rng, n % 3)
        for skip in (True, False):
            want = tokenizer.decode(ids, skip_special_tokens=skip)
            got, h = _streamed(Detokenizer(tokenizer, skip), ids, rng)
            assert got == want, (ids, skip)
            held += h
            said += not skip and want != tokenizer.decode(ids, skip_special_tokens=True)
        one = "".join(e.text for e in token_events(tokenizer, ids))
        assert one == tokenizer.decode(ids, skip_special_tokens=True)
    assert held > 0, "some chunks end inside a character and are held back"
    assert said > 0, "special tokens are said when not skipped"


def test_decode_options_reach_the_tokenizer(smollm2_dir: Path) -> None:
    tok = _tokenizer(smollm2_dir)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = [end, *tok.encode("Hi 😀", add_special_tokens=False), end, end]
    ids += tok.encode(" there", add_special_tokens=False)
    rng = random.Random(0)
    assert _streamed(Detokenizer(tok), ids, rng)[0] == "Hi 😀 there"
    assert _streamed(Detokenizer(tok, False), ids, rng)[0] == (
        "<|im_end|>Hi 😀<|im_end|><|im_end|> there"
    )
    fake = FakeTokenizer()  # the fake engine's words: its end token (id 0) is special
    ids = [fake.id_of("a"), 0, fake.id_of("b"), 0]
    assert _streamed(Detokenizer(fake, False), ids, rng)[0] == "a <eos> b <eos>"
    assert _streamed(Detokenizer(fake, False, False), ids, rng)[0] == "a<eos>b<eos>"
    assert _streamed(Detokenizer(fake), ids, rng)[0] == "a b"


def _llama_style():
    """A Llama-style tokenizer built here (SentencePiece pieces, byte fallback, a decoder that
    strips the text's leading space): a leading "▁" says nothing alone, but does before text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    vocab = {p: i for i, p in enumerate([*pieces, "▁", "▁▁", "a", "▁a", "▁b", ",", "é", "東"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1),
        ]
    )
    tok.add_special_tokens([AddedToken(p, special=True) for p in pieces[:3]])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


def test_a_decoder_that_strips_the_leading_space() -> None:
    tok = _llama_style()
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(rng.choice(CHARS) for _ in range(rng.randint(1, 16)))
        ids = [2, 2, *tok.encode(text, add_special_tokens=False)]  # after end tokens, as well
        at = rng.randint(2, len(ids))  # a special token between characters' tokens (among the
        if not any(3 <= i < 259 for i in ids[at - 1 : at + 1]):  # bytes of one, it makes the
            ids.insert(at, 2)  # decoder replace those already said)
        for skip in (True, False):
            assert _streamed(Detokenizer(tok, skip), ids, rng)[0] == tok.decode(ids, skip), ids


class _Counting:
    """A tokenizer that records how many tokens each decode call is given."""

    def __init__(self, tok) -> None:
        self.tok, self.sizes = tok, []

    def decode(self, ids, **options) -> str:
        self.sizes.append(len(ids))
        return self.tok.decode(ids, **options)


def test_the_work_per_token_does_not_grow_with_the_answer(smollm2_dir: Path) -> None:
    tok = _tokenizer(smollm2_dir)
    rng = random.Random(0)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    text = "".join(rng.choice(CHARS) for _ in range(1500))
    ids = [end] * 50 + tok.encode(text, add_special_tokens=False)
    ids[len(ids) // 2 : len(ids) // 2] = [end] * 200  # a run of skipped special tokens
    assert len(ids) > 2000
    for skip in (True, False):
        counting = _Counting(tok)
        detok = Detokenizer(counting, skip)
        pieces = [detok.push([t]).text for t in ids] + [detok.flush().text]
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
        assert max(counting.sizes) <= 8, "a push decodes the last piece's tokens and the new"
        assert len(counting.sizes) <= 2 * len(ids) + 1, "at most two decodes per push"
