"""Reference images in: decode, check limits, center-crop and resize to the video size.

Raises ImageError (-> INVALID_ARGUMENT) with a message a client can act on.
"""

from __future__ import annotations

import dataclasses
import io

import numpy as np

DEFAULT_MAX_BYTES = 4 << 20  # 4 MiB
DEFAULT_MAX_PIXELS = 4096 * 4096


class ImageError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = DEFAULT_MAX_BYTES
    max_pixels: int = DEFAULT_MAX_PIXELS


def load_reference_image(data: bytes, width: int, height: int, limits: ImageLimits = ImageLimits()) -> np.ndarray:
    """Encoded image bytes -> [height, width, 3] uint8 RGB (center-cropped to the aspect, resized)."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ImageError("image: empty; send the bytes of a PNG, JPEG or WebP file")
    if len(data) > limits.max_bytes:
        raise ImageError(f"image: {len(data)} bytes is over the limit of {limits.max_bytes} bytes")
    try:
        img = Image.open(io.BytesIO(data))
        w, h = img.size
        if w * h > limits.max_pixels:
            raise ImageError(f"image: {w}x{h} = {w * h} pixels is over the limit of {limits.max_pixels} pixels")
        img.load()
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as err:
        raise ImageError(f"image: the bytes are not a readable image ({type(err).__name__}: {err})") from None
    img = img.convert("RGB")
    target = width / height
    if w / h > target:  # too wide: crop the sides
        cw = max(1, round(h * target))
        box = ((w - cw) // 2, 0, (w - cw) // 2 + cw, h)
    else:
        ch = max(1, round(w / target))
        box = (0, (h - ch) // 2, w, (h - ch) // 2 + ch)
    img = img.crop(box).resize((width, height), Image.Resampling.BICUBIC)
    return np.asarray(img, dtype=np.uint8)
