"""Reference runner oracles on both tiny families, against transformers' own forward/generate:
every token recomputed through the selective path = a plain HF prefill (logits, greedy tokens);
an image linked where it was cached, after the same context, is exact with no recompute; bad
input fails before anything is computed."""

import io

import pytest
import torch

from mpic.engine.hf.reference_runner import ReferenceRunner
from mpic.errors import NotFoundError, PromptTooLongError
from mpic.linker.prompt import CONTEXT_LEAD_IN, ImageRef


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def runner(tiny_model_dir, sample_images):
    r = ReferenceRunner(str(tiny_model_dir))
    r.test_ids = [r.cache_image(_png(img)).entry_id for img in sample_images[:2]]
    return r


def _hf_inputs(runner, parts, images):
    """What a plain HF user would feed: the processor's own expansion of the same prompt."""
    tok = runner.processor.tokenizer
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image"} if isinstance(p, ImageRef) else {"type": "text", "text": p}
                for p in parts
            ],
        }
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return runner.processor(text=text, images=images, return_tensors="pt")


def test_full_recompute_equals_hf_prefill_and_greedy(runner, sample_images):
    a, b = runner.test_ids
    parts = ["Compare", ImageRef(a), "with", ImageRef(b), "and again", ImageRef(a), "briefly."]
    inputs = _hf_inputs(runner, parts, [sample_images[0], sample_images[1], sample_images[0]])
    gen = runner.generate(parts, "full", max_new_tokens=8, stop_at_eos=False)
    assert torch.equal(gen.prefilled.plan.token_ids, inputs["input_ids"][0])
    with torch.inference_mode():
        hf_logits = runner.model(**inputs).logits[0, -1].float()
        hf_tokens = runner.model.generate(**inputs, max_new_tokens=8, do_sample=False)[
            0, inputs["input_ids"].shape[1] :
        ]  # HF stops at EOS (min_new_tokens would mask EOS out of its greedy choice)
    torch.testing.assert_close(gen.prefilled.logits, hf_logits, rtol=1e-4, atol=1e-4)
    assert gen.tokens[: hf_tokens.numel()] == hf_tokens.tolist()
    assert gen.prefilled.recomputed_tokens == gen.prefilled.plan.num_tokens


def test_same_place_same_context_needs_no_item_recompute(runner, sample_images):
    a = runner.test_ids[0]
    parts = [CONTEXT_LEAD_IN, ImageRef(a), "What is this?"]
    exact = runner.prefill(parts, "full")
    linked = runner.prefill(parts, "mpic-0")
    items = ~linked.plan.is_text
    t = runner.entries[a].num_tokens
    assert int(items.sum()) == t
    assert linked.cached_prefix > 0  # the canonical context before the image: linked exactly
    assert linked.recomputed_tokens == linked.plan.num_tokens - t - linked.cached_prefix
    torch.testing.assert_close(linked.logits, exact.logits, rtol=1e-4, atol=1e-4)
    prefix = runner.prefill(parts, "prefix")  # the prompt starts like the canonical context
    assert prefix.recomputed_tokens == linked.recomputed_tokens + linked.cached_prefix
    torch.testing.assert_close(prefix.logits, exact.logits, rtol=1e-4, atol=1e-4)
    moved = runner.prefill(["Some words first.", ImageRef(a), "What is this?"], "mpic-0")
    exact_moved = runner.prefill(["Some words first.", ImageRef(a), "What is this?"], "full")
    assert (moved.logits - exact_moved.logits).abs().max() > 1e-3  # moved: approximate


def test_bad_input_is_rejected_before_any_work(runner):
    with pytest.raises(NotFoundError):
        runner.prefill(["hi", ImageRef("0" * 64)], "mpic-32")
    with pytest.raises(PromptTooLongError):
        runner.prefill(["word " * runner.spec.max_model_len], "mpic-32")
    with pytest.raises(ValueError, match="valid"):
        runner.prefill(["hi"], "nope")


def test_sampling_is_seeded(runner):
    parts = [ImageRef(runner.test_ids[1]), "Describe."]
    one = runner.generate(parts, "mpic-4", 6, temperature=1.0, seed=3, stop_at_eos=False).tokens
    two = runner.generate(parts, "mpic-4", 6, temperature=1.0, seed=3, stop_at_eos=False).tokens
    assert one == two and len(one) == 6


def test_stream_yields_generate_tokens_and_honours_system_prompt(runner):
    parts = [ImageRef(runner.test_ids[0]), "Describe."]
    streamed = [t for t, _ in runner.stream(parts, "mpic-4", 5, stop_at_eos=False)]
    assert streamed == runner.generate(parts, "mpic-4", 5, stop_at_eos=False).tokens
    plan = runner.plan(parts).plan
    other = runner.plan(parts, system_prompt="You answer in one word.").plan
    assert other.num_tokens != plan.num_tokens or not torch.equal(other.token_ids, plan.token_ids)


def test_an_image_longer_than_the_model_is_refused(runner, sample_images, monkeypatch):
    """An image whose canonical context and tokens exceed the model's length: 400-kind error
    naming the file, before an entry exists (both engines check it: `check_item_length`)."""
    import dataclasses

    short = dataclasses.replace(runner.spec, max_model_len=len(CONTEXT_LEAD_IN) // 8)
    monkeypatch.setattr(runner, "spec", short)
    before = dict(runner.entries)
    with pytest.raises(PromptTooLongError, match="the image has") as err:
        runner.cache_image(_png(sample_images[2]))
    assert err.value.param == "file" and runner.entries == before
