"""Test-only stand-in for ``torchvision`` in kvbridge's SGLang test environment.

Not part of kvbridge; see ``tests/sglang_stubs/README.md``. The registry's torchvision
wheels are CUDA builds whose native ops fail to load next to CPU torch, which makes
``import torchvision`` itself raise. SGLang 0.5.23 imports ``torchvision.transforms`` at
module level on every run (``sglang.srt.configs`` -> ``nano_nemotron_vl`` ->
``multimodal/internvl_utils.py``), and transformers, once it sees a ``torchvision``
package, imports a few names from it at module level. This stand-in provides exactly
those names: the two enums are real, every function raises ``NotImplementedError``.
Text-only models never call them; image and video inputs are not supported.
"""

__version__ = "0.28.0"  # the torchvision release that pairs with torch 2.13


def _unavailable(name: str):
    def fn(*args, **kwargs):
        raise NotImplementedError(
            f"torchvision.{name} is not available: this is kvbridge's test-only torchvision "
            f"stand-in (tests/sglang_stubs), which supports text-only models"
        )

    fn.__name__ = fn.__qualname__ = name.rsplit(".", 1)[-1]
    return fn


from . import io, transforms  # noqa: E402,F401  (after _unavailable, which they use)
