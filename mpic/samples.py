"""Sample inputs shared by the demo, the benchmarks and the VLCache calibration (any process):
deterministic synthetic images and an interleaved prompt with new text around cached images."""

from __future__ import annotations

import io

from mpic.prompt_parts import ImageRef, PromptPart

_GAPS = ["Next comes another picture:", "And this one:", "Then look at", "Compare it with"]


def synthetic_png(index: int, size: int = 96) -> bytes:
    """A deterministic, distinct RGB test image (coloured gradient with a seeded block)."""
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(index)
    ys, xs = np.mgrid[0:size, 0:size]
    base = rng.randint(0, 256, 3)
    img = np.stack([(xs * (c % 7 + 1) + base[c]) % 256 for c in range(3)], -1).astype(np.uint8)
    y0, x0 = rng.randint(0, size // 2, 2)
    img[y0 : y0 + size // 3, x0 : x0 + size // 3] = rng.randint(0, 256, 3)
    img = np.where((ys + xs + index)[..., None] % 11 == 0, 255 - img, img).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "PNG")
    return buf.getvalue()


def interleaved_prompt(entry_ids: list[str]) -> list[PromptPart]:
    """New question text before, between and after the images."""
    parts: list[PromptPart] = ["I am going to show you some pictures of my trip."]
    for i, entry_id in enumerate(entry_ids):
        if i:
            parts.append(_GAPS[i % len(_GAPS)])
        parts.append(ImageRef(entry_id))
    parts.append("Which picture shows the most red, and what happens in the last one?")
    return parts
