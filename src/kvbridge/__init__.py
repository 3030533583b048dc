"""kvbridge: KV-cache transfer for disaggregated LLM serving.

Moves the KV cache of prefill instances to decode instances (vLLM, SGLang) over NIXL
or Mooncake. Importing this package imports no engine and no transport backend.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvbridge")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0+unknown"

__all__ = ["__version__"]
