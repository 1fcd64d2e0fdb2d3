"""The task of `mpic bench fidelity --task needle` (benchmarks/fidelity/task.py): the planted
fact lands where asked, and on the trained SmolLM2 full prefill finds the code the prompt without
the documents cannot know, with each policy's accuracy and its ratio to full."""

from __future__ import annotations

import pytest

from mpic.benchmarks.fidelity.task import DEPTHS, needle_parts, plant, run_task

TEXT = "First paragraph.\n\nSecond paragraph, longer than the first.\n\nThird one."


def test_the_fact_is_planted_at_each_depth():
    fact = "The secret code is 4821."
    assert plant(TEXT, 4821, "start") == f"{fact}\n\n{TEXT}"
    assert plant(TEXT, 4821, "end") == f"{TEXT}\n\n{fact}"
    middle = plant(TEXT, 4821, "middle")
    assert middle.replace(f"\n\n{fact}", "") == TEXT
    assert middle.index("First") < middle.index(fact) < middle.index("Third")
    assert plant("one paragraph", 1, "middle").endswith("The secret code is 1.")
    assert set(DEPTHS) == {"start", "middle", "end"}
    with pytest.raises(ValueError, match="middle"):
        plant(TEXT, 1, "deep")


def test_the_prompt_names_every_document_and_asks_last():
    from mpic.prompt_parts import DocumentRef

    parts = needle_parts(["json", "heapq"], ["e1", "e2"])
    assert [p.entry_id for p in parts if isinstance(p, DocumentRef)] == ["e1", "e2"]
    assert "Document 2 (heapq)" in parts[3] and parts[-1].endswith("number only.")


def test_full_prefill_finds_the_code_the_bare_prompt_cannot(smollm2_runner):
    from mpic.benchmarks.fidelity.prompts import passages
    from mpic.engine.hf.engine import ReferenceEngine

    docs = passages(2, 400)
    rows = run_task(ReferenceEngine(smollm2_runner), docs, [2], ["full", "mpic-32"], trials=2)
    by = {r["policy"]: r for r in rows}
    assert set(by) == {"full", "mpic-32"}
    full = by["full"]
    assert full["accuracy"] >= 0.5 and full["no_items"] == 0.0
    assert full["kl_first"] == 0.0 and full["recomputed_fraction"] == 1.0
    mpic = by["mpic-32"]
    assert mpic["accuracy_vs_full"] == pytest.approx(mpic["accuracy"] / full["accuracy"])
    assert 0 < mpic["recomputed_fraction"] < 1 and mpic["kl_first"] > 0


def test_the_seed_picks_the_trials_codes():
    """`--task-seed`: the same seed plants the same codes, another seed other ones (held-out
    trials), in the same documents at the same depths (a stub engine: no model)."""
    from types import SimpleNamespace

    import torch

    from mpic.engine.first_token import FirstToken
    from mpic.engine.protocol import Decoded, Prefill

    class Stub:
        processor = SimpleNamespace(decode=lambda tokens, skip_special_tokens=True: "")
        spec = SimpleNamespace(vocab_size=4, end_token_ids=[0])

        def __init__(self):
            self.planted = []

        def cache_document(self, text):
            if "secret code" in text:
                self.planted.append(text)
            return SimpleNamespace(entry_id=f"e{len(text)}-{hash(text)}")

        async def decode(self, request):
            first = FirstToken.from_logits(torch.zeros(4))
            yield Decoded([], prefill=Prefill(10, 0, 0.0, first_token=first, recomputed_tokens=10))

    docs = [SimpleNamespace(name=f"d{i}", text=f"Passage {i}.\n\nMore text {i}.") for i in range(3)]
    runs = {}
    for key, seed in (("a", 0), ("b", 0), ("c", 1)):
        stub = Stub()
        rows = run_task(stub, docs, [3], ["full"], trials=4, seed=seed)
        assert rows[0]["trials"] == 4 and rows[0]["accuracy_vs_full"] is None
        runs[key] = stub.planted
    assert runs["a"] == runs["b"] and len(runs["a"]) == 4
    assert runs["a"] != runs["c"]
    for x, y in zip(runs["a"], runs["c"], strict=True):  # same document and depth, other code
        assert x.split("The secret code is")[0] == y.split("The secret code is")[0]
