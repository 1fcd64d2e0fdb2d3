"""Bounds on an uploaded image read from its header alone (Encoder Serve replica): PIL opens
lazily, so no pixel is decoded before decompression bombs (413) and sides or aspect ratios a
processor's resize would blow up (400) are refused."""

from __future__ import annotations

import io
import warnings

from mpic.errors import InvalidRequestError, PayloadTooLargeError


class ImageSizeError(InvalidRequestError):
    """An image side or aspect ratio over the limits (HTTP 400, code `invalid_image_size`)."""

    code = "invalid_image_size"


def check_image_pixels(
    data: bytes, max_pixels: int, max_side: int | None = None, max_aspect: float | None = None
) -> None:
    """Refuse an image from its header alone (PIL opens lazily: no pixel is decoded, nothing is
    resized): 413 when it declares more than `max_pixels` pixels (decompression bombs), 400 when
    a side is over `max_side` or the longest side over the shortest is over `max_aspect` (resize
    bombs: a 100,000 x 1 image whose short side a processor scales up to 336 pixels would become
    33.6 M x 336). Bytes PIL cannot identify pass through (the engine answers 415 for them)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as im:
                width, height = im.size
                frames = getattr(im, "n_frames", 1)
    except Image.DecompressionBombError:
        raise PayloadTooLargeError(
            f"image over the {max_pixels}-pixel limit", param="file"
        ) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        return
    if width * height > max_pixels or width * height * frames > 4 * max_pixels:
        raise PayloadTooLargeError(
            f"image of {width}x{height} pixels is over the {max_pixels}-pixel limit", param="file"
        )
    if min(width, height) < 1 or (max_side is not None and max(width, height) > max_side):
        raise ImageSizeError(
            f"image of {width}x{height} pixels: each side must be 1 to {max_side} pixels",
            param="file",
        )
    if max_aspect is not None and max(width, height) > max_aspect * min(width, height):
        raise ImageSizeError(
            f"image of {width}x{height} pixels: the aspect ratio is over {max_aspect:g}:1",
            param="file",
        )
