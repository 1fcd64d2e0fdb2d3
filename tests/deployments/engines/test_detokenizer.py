"""Streamed text (`mpic.engine.detokenize.Detokenizer`, LLM-worker replicas): pieces pushed
one token or several at a time join to the decoded text, and a piece never ends in an
incomplete character (U+FFFD) while more tokens may complete it."""

from __future__ import annotations

import random
from pathlib import Path

from mpic.engine.detokenize import Detokenizer, token_events


def test_pieces_join_to_the_decoded_text(tiny_llava_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llava_dir))
    rng = random.Random(0)
    held = 0
    for _ in range(100):
        ids = [rng.randrange(tok.vocab_size) for _ in range(24)]
        want = tok.decode(ids, skip_special_tokens=True)
        assert "".join(e.text for e in token_events(tok, ids)) == want
        detok, pieces, i = Detokenizer(tok), [], 0
        while i < len(ids):  # uneven chunks, as vLLM emits them under load
            step = rng.randint(1, 4)
            piece = detok.push(ids[i : i + step]).text
            held += piece == "" and step > 0
            assert not piece.endswith("\ufffd")
            pieces.append(piece)
            i += step
        assert "".join(pieces) + detok.flush().text == want
    assert held > 0, "some random chunks end inside a character and are held back"
