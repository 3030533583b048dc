"""The README and the docstrings' examples stay true to the code they document."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import msgspec
import pytest

import kvbridge
from kvbridge.config import KVBridgeConfig, config_keys

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
PACKAGE = Path(kvbridge.__file__).parent
WITH_EXAMPLES = sorted(
    ".".join(("kvbridge", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(
        ".__init__"
    )
    for path in PACKAGE.rglob("*.py")
    if ">>> " in path.read_text()
)


def test_readme_documents_every_config_key_with_its_default() -> None:
    defaults = msgspec.json.decode(msgspec.json.encode(KVBridgeConfig()))
    for key in config_keys():
        value = defaults
        for part in key.split("."):
            value = value[part]
        row = next((line for line in README.splitlines() if line.startswith(f"| `{key}` |")), None)
        assert row is not None, f"README's config table lacks {key}"
        shown = row.split("|")[2].strip().strip("`")
        assert msgspec.json.decode(shown) == value, (
            f"README shows {key} = {shown}, code default is {value!r}"
        )


def test_the_package_has_docstring_examples_to_run() -> None:
    assert len(WITH_EXAMPLES) >= 20, WITH_EXAMPLES


@pytest.mark.parametrize("module", WITH_EXAMPLES)
def test_docstring_examples_run(module: str) -> None:
    """Every ``>>>`` example in the module's docstrings gives the output written under it
    (doctest prints a failing example's expected and actual output)."""
    failed, attempted = doctest.testmod(importlib.import_module(module), report=True)
    assert attempted > 0 and failed == 0, f"{failed} of {attempted} examples in {module} failed"
