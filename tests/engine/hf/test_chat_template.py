"""`--chat-template` as a model-folder overlay (`mpic.engine.hf.chat_template`): the processor and
tokenizer loaded from the overlay render the given template, the model folder is untouched, the
same (folder, template) gives the same overlay, and a path that names no file is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}"
    "{% else %}<image>{% endif %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def test_overlay_renders_the_template(tiny_llava_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoProcessor

    from mpic.engine.hf.chat_template import with_chat_template
    from mpic.model_spec import ModelSpec

    before = AutoProcessor.from_pretrained(tiny_llava_dir).chat_template
    file = tmp_path / "t.jinja"
    file.write_text(TEMPLATE)
    out = with_chat_template(str(tiny_llava_dir), str(file), tmp_path / "cache")
    assert with_chat_template(str(tiny_llava_dir), TEMPLATE, tmp_path / "cache") == out
    proc = AutoProcessor.from_pretrained(out)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "[user]hi[assistant]"
    )
    assert proc.tokenizer.chat_template == TEMPLATE
    assert AutoProcessor.from_pretrained(tiny_llava_dir).chat_template == before  # untouched
    assert ModelSpec.from_pretrained(out).fingerprint == (
        ModelSpec.from_pretrained(tiny_llava_dir).fingerprint
    )
    with pytest.raises(FileNotFoundError):
        with_chat_template(str(tiny_llava_dir), str(tmp_path / "missing.jinja"), tmp_path)
