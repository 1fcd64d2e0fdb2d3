"""Saving a random or converted model's weights under the checkpoint names both transformers and
vLLM load (`mpic model make-tiny`, `make_llava_smollm2`)."""

from __future__ import annotations

from pathlib import Path


def write_weights(model, family: str, out: Path) -> None:
    """model.safetensors with the checkpoint names both transformers and vLLM load.

    transformers 5 names CLIP's modules `vision_tower.embeddings...`; vLLM (and older checkpoints)
    expect `vision_tower.vision_model.embeddings...`, which transformers maps back on load.
    """
    from safetensors.torch import save_file

    tensors = {}
    for name, tensor in model.state_dict().items():
        if family in ("llava", "llava-next") and name.startswith("model.vision_tower."):
            name = "model.vision_tower.vision_model." + name[len("model.vision_tower.") :]
        tensors[name] = tensor.contiguous().cpu()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
