"""The tiny models load in vLLM (CPU) and generate exactly what transformers generates for a
prompt with an image: same expanded prompt ids, same greedy tokens. Slow: one engine start-up
(30-120 s on 2 cores) per family, in a subprocess because vLLM spawns its own processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from mpic.engine.hf.vision import image_layout

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from PIL import Image

    def main():
        model, prompt, image_path, out = sys.argv[1:5]
        from vllm import LLM, SamplingParams
        llm = LLM(model=model, dtype="float32", block_size=32, max_model_len=1024,
                  max_num_batched_tokens=1024, max_num_seqs=1, enforce_eager=True,
                  limit_mm_per_prompt={"image": 1})
        image = Image.open(image_path).convert("RGB")
        result = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}},
                              SamplingParams(max_tokens=8, temperature=0.0))[0]
        with open(out, "w") as handle:
            json.dump({"prompt_ids": list(result.prompt_token_ids),
                       "tokens": list(result.outputs[0].token_ids)}, handle)

    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.slow
def test_vllm_generates_what_transformers_generates(
    tiny_hf, tiny_model_dir, sample_images, tmp_path
):
    pytest.importorskip("vllm")
    model, processor, spec = tiny_hf
    image = sample_images[1]
    image.save(tmp_path / "image.png")
    content = [
        {"type": "text", "text": "Look:"},
        {"type": "image"},
        {"type": "text", "text": "What is it?"},
    ]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )
    inputs = processor(text=prompt, images=[image], return_tensors="pt")
    with torch.no_grad():
        expected = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    expected_tokens = expected[0, inputs["input_ids"].shape[1] :].tolist()

    (tmp_path / "run.py").write_text(_SCRIPT)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run(
        [
            sys.executable,
            str(tmp_path / "run.py"),
            str(tiny_model_dir),
            prompt,
            str(tmp_path / "image.png"),
            str(tmp_path / "out.json"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["prompt_ids"] == inputs["input_ids"][0].tolist()
    expected_t = image_layout(processor, image).num_tokens
    assert got["prompt_ids"].count(spec.image_token_id) == expected_t
    assert got["tokens"] == expected_tokens
