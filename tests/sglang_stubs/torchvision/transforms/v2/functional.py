"""``torchvision.transforms.v2.functional``: imported as a module by transformers; no
function of it is called for text-only models."""

from ... import _unavailable
from .. import InterpolationMode  # noqa: F401

resize = _unavailable("transforms.v2.functional.resize")
pil_to_tensor = _unavailable("transforms.v2.functional.pil_to_tensor")
