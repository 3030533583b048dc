"""``torchvision.transforms``: SGLang imports the module and ``InterpolationMode``."""

import enum


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


from . import functional  # noqa: E402,F401
