"""``torchvision.io`` names transformers imports at module level (image_utils.py)."""

import enum

from . import _unavailable


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4
    RGBA = RGB_ALPHA


decode_image = _unavailable("io.decode_image")
decode_jpeg = _unavailable("io.decode_jpeg")
