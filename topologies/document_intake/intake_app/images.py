"""The intake's checks of an uploaded image, with the reason of every refusal, and its hashes.

Each refusal is an exception whose class names the DLQ reason (the stage seam snake-cases it):
``Oversize``, ``UnsupportedFormat`` (not PNG or JPEG by its magic bytes, whatever the uploader said),
``CorruptImage``, ``BadDimensions``, ``UnsupportedColourSpace``, ``DuplicateContent``. A grey, palette,
RGBA or CMYK image is converted to RGB (alpha flattened on white) and re-encoded as PNG, as the seeds'
failure case asks ("CMYK → expected 3 channels, got 4"); a 16-bit or floating-point image is refused.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass

import imagehash
from PIL import Image

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
JPEG_MAGIC = b"\xff\xd8\xff"
CONVERTIBLE = frozenset({"L", "LA", "P", "PA", "RGBA", "RGBa", "CMYK", "1"})


class ImageRejected(Exception):
    """An upload the intake refuses; the subclass is the DLQ reason."""


class Oversize(ImageRejected):
    pass


class UnsupportedFormat(ImageRejected):
    pass


class CorruptImage(ImageRejected):
    pass


class BadDimensions(ImageRejected):
    pass


class UnsupportedColourSpace(ImageRejected):
    pass


class DuplicateContent(ImageRejected):
    pass


@dataclass(frozen=True)
class CheckedImage:
    """An accepted image: RGB bytes to pass on (the upload's own, or the converted PNG) and what was found."""

    data: bytes
    format: str
    width: int
    height: int
    colour_mode: str
    converted: bool
    sha256: str
    phash: str


def sniff(data: bytes) -> str:
    if data.startswith(PNG_MAGIC):
        return "png"
    if data.startswith(JPEG_MAGIC):
        return "jpeg"
    raise UnsupportedFormat(f"not a PNG or JPEG file (first bytes {data[:8].hex()}); upload a PNG or JPEG scan")


def check_image(data: bytes, *, max_bytes: int, min_side: int, max_side: int, phash_size: int) -> CheckedImage:
    """Size, format, dimensions and colour space of an upload; raises the refusal with its reason."""
    if len(data) > max_bytes:
        raise Oversize(f"{len(data)} bytes exceeds the limit of {max_bytes}")
    fmt = sniff(data)
    sha256 = content_digest(data)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if max(width, height) > max_side or min(width, height) < min_side:
                raise BadDimensions(f"{width}x{height}: each side must be between {min_side} and {max_side} pixels")
            image.load()
    except ImageRejected:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise CorruptImage(f"the {fmt.upper()} file cannot be decoded: {exc}") from None
    mode = image.mode
    converted = False
    if mode != "RGB":
        if mode not in CONVERTIBLE:
            raise UnsupportedColourSpace(f"colour mode {mode} is not converted (accepted: RGB; converted: "
                                         f"{', '.join(sorted(CONVERTIBLE))}); export the scan as 8-bit RGB")
        if "A" in mode or mode == "P" and "transparency" in image.info:
            rgba = image.convert("RGBA")
            flat = Image.new("RGB", rgba.size, (255, 255, 255))
            flat.paste(rgba, mask=rgba.getchannel("A"))
            image = flat
        else:
            image = image.convert("RGB")
        buffer = io.BytesIO()
        image.save(buffer, "PNG", compress_level=1)
        data, fmt, converted = buffer.getvalue(), "png", True
    return CheckedImage(data=data, format=fmt, width=width, height=height, colour_mode=mode, converted=converted,
                        sha256=sha256, phash=str(imagehash.phash(image, hash_size=phash_size)))


def content_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
