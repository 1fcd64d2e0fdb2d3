"""The vLLM front end refuses an image whose canonical upload prompt (context + image tokens)
exceeds the engine's context length with the same error as the reference runner, before vLLM is
asked (fast: no engine; vLLM's own check would raise its `VLLMValidationError`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mpic.errors import PromptTooLongError
from mpic.model_spec import ModelSpec
from mpic.samples import synthetic_png


def test_an_image_over_the_context_length_is_refused_before_vllm(tiny_llava_dir) -> None:
    pytest.importorskip("vllm")
    from mpic.engine.vllm.frontend import VllmFrontEnd

    front = VllmFrontEnd.__new__(VllmFrontEnd)  # the upload form needs no engine
    front._processor = None  # loaded from the spec's folder on first use
    front.spec = ModelSpec.from_pretrained(str(tiny_llava_dir))
    front.cfg = SimpleNamespace(max_model_len=4096)
    ids, _, span, _, extra = front._upload_form(synthetic_png(0), None)
    assert span[0] == len(extra["context_token_ids"]) and span[1] > span[0]
    front.cfg = SimpleNamespace(max_model_len=span[1] - 1)
    with pytest.raises(PromptTooLongError, match="the image has") as err:
        front._upload_form(synthetic_png(0), None)
    assert err.value.param == "file"
