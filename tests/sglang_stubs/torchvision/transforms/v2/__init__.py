"""``torchvision.transforms.v2``: transformers imports its ``functional`` module."""

from . import functional  # noqa: F401
