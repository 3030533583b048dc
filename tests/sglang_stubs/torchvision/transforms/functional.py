"""``torchvision.transforms.functional``: ``InterpolationMode`` (SGLang) and
``pil_to_tensor`` (transformers) are imported at module level; ``resize`` is named by
SGLang's video processors."""

from .. import _unavailable
from . import InterpolationMode  # noqa: F401

pil_to_tensor = _unavailable("transforms.functional.pil_to_tensor")
resize = _unavailable("transforms.functional.resize")
