"""Reference images in: decode, check limits, center-crop and resize to the video size.

Only PNG, JPEG and WebP are opened (Pillow's other readers never see the bytes). The size in
bytes is checked before anything is parsed, the pixel count from the header before the pixels
are decoded. Every failure is an ImageError (-> INVALID_ARGUMENT) with a message a client can
act on: what is wrong, never a Python object's repr or a memory address.
"""

from __future__ import annotations

import io
import re

import numpy as np

from characters_jax.config import ImageLimits  # the [serve] table's image limits

ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP")
_ACCEPTED_NAMES = "a PNG, JPEG or WebP file"
_MAX_DETAIL_CHARS = 160

# Leading bytes -> the format's name: to say what an unaccepted file is, without parsing it.
_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"DDS ", "DDS"),
    (b"BM", "BMP"),
    (b"%!PS", "EPS"),
    (b"\xc5\xd0\xd3\xc6", "EPS"),
    (b"8BPS", "PSD"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"icns", "ICNS"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
    (b"\xff\x4f\xff\x51", "JPEG 2000"),
    (b"qoif", "QOI"),
    (b"%PDF", "PDF"),
)
_DISPLAY_NAMES = {"WEBP": "WebP"}
_BOMB_PIXELS = re.compile(r"Image size \((\d+) pixels\) exceeds limit of (\d+) pixels")
_OBJECT_REPR = re.compile(r"<[^<>]*\bat 0x[0-9a-fA-F]+>")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")


class ImageError(ValueError):
    """An image the service cannot use. `reason`: "empty", "too_large", "format" (not PNG,
    JPEG or WebP), "damaged" (an accepted format that does not decode) or "too_many_pixels"."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason


def sniff_format(data: bytes) -> str | None:
    """The format's name from its leading bytes ("PNG", "WEBP", "TIFF", ...), or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return next((name for magic, name in _MAGIC if data.startswith(magic)), None)


def clean_detail(err: BaseException) -> str:
    """A library's exception as "Type: message", one line, no object reprs or addresses, bounded."""
    text = " ".join(str(err).split())
    text = _ADDRESS.sub("0x...", _OBJECT_REPR.sub("the data", text))
    if len(text) > _MAX_DETAIL_CHARS:
        text = text[: _MAX_DETAIL_CHARS - 3] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _pixels_error(w: int, h: int, limits: ImageLimits) -> ImageError:
    return ImageError(f"image: {w} x {h} = {w * h} pixels is over the limit of {limits.max_pixels} pixels", "too_many_pixels")


def _unidentified(data: bytes) -> ImageError:
    kind = sniff_format(data)
    if kind is None:
        return ImageError(f"image: the bytes are not a readable image; send the bytes of {_ACCEPTED_NAMES}", "format")
    name = _DISPLAY_NAMES.get(kind, kind)
    if kind in ACCEPTED_FORMATS:
        return ImageError(f"image: the bytes are not a readable image: they start like a {name} file but its header is damaged", "damaged")
    return ImageError(f"image: the bytes are not a readable image: {name} files are not accepted; send {_ACCEPTED_NAMES}", "format")


def _bomb(err: Exception, limits: ImageLimits) -> ImageError:
    """Pillow's own pixel ceiling (met before ours where ours is set above it)."""
    m = _BOMB_PIXELS.search(str(err))
    size, limit = (int(m.group(1)), min(int(m.group(2)), limits.max_pixels)) if m else ("the image's", limits.max_pixels)
    return ImageError(f"image: {size} pixels is over the limit of {limit} pixels", "too_many_pixels")


def _decode_rgb(data: bytes, limits: ImageLimits):
    """bytes -> a loaded Pillow image in mode RGB. Raises ImageError for anything Pillow raises."""
    from PIL import Image, UnidentifiedImageError

    fmt = sniff_format(data) or "image"
    try:
        img = Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)
        fmt = img.format or fmt
        w, h = img.size
        if w * h > limits.max_pixels:
            raise _pixels_error(w, h, limits)
        img.load()
        if img.mode in ("P", "PA"):  # through RGBA: a palette's transparency is dropped without a warning
            img = img.convert("RGBA")
        return img.convert("RGB")
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise _unidentified(data) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:  # the warning, where warnings are errors
        raise _bomb(err, limits) from None
    except Exception as err:  # SyntaxError, OSError, EOFError, struct.error, NotImplementedError, ...: damaged data
        name = _DISPLAY_NAMES.get(fmt, fmt)
        raise ImageError(f"image: the bytes are not a readable image: the {name} data is damaged or truncated ({clean_detail(err)})", "damaged") from None


def load_reference_image(data: bytes, width: int, height: int, limits: ImageLimits = ImageLimits()) -> np.ndarray:
    """Encoded PNG, JPEG or WebP bytes -> [height, width, 3] uint8 RGB (center-cropped to the
    aspect, resized). Raises ImageError."""
    from PIL import Image

    if not data:
        raise ImageError(f"image: empty; send the bytes of {_ACCEPTED_NAMES}", "empty")
    if len(data) > limits.max_bytes:
        raise ImageError(f"image: {len(data)} bytes is over the limit of {limits.max_bytes} bytes", "too_large")
    img = _decode_rgb(data, limits)
    w, h = img.size
    target = width / height
    if w / h > target:  # too wide: crop the sides
        cw = max(1, round(h * target))
        box = ((w - cw) // 2, 0, (w - cw) // 2 + cw, h)
    else:
        ch = max(1, round(w / target))
        box = (0, (h - ch) // 2, w, (h - ch) // 2 + ch)
    img = img.crop(box).resize((width, height), Image.Resampling.BICUBIC)
    return np.asarray(img, dtype=np.uint8)
