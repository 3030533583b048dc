"""The README and the docstrings' examples stay true to the code they document."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import msgspec
import pytest

import kvbridge
from kvbridge.config import KVBridgeConfig, config_keys
from kvbridge.runtime.stats import COUNTERS, GAUGES, HISTOGRAMS, REQUEST_GAUGES

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


def _metrics_table() -> dict[str, tuple[str, str]]:
    """README's metrics table: metric name -> (kind, engines)."""
    start = README.index("\n## Metrics\n")
    section = README[start : README.index("\n## ", start + 1)]
    rows = [line.split("|") for line in section.splitlines() if line.startswith("| `kvbridge_")]
    return {row[1].strip().strip("`"): (row[2].strip(), row[3].strip()) for row in rows}


def test_readme_lists_every_metric_with_its_kind() -> None:
    """Every metric the adapters export (the catalogues of :mod:`kvbridge.runtime.stats`)
    has a row of its kind in README's table, and the table names no other."""
    expected = {
        **{f"kvbridge_{name}_total": "counter" for name in COUNTERS},
        **{f"kvbridge_{name}": "histogram" for name, _ in HISTOGRAMS.values()},
        **{f"kvbridge_{name}": "gauge" for name in (*GAUGES, *REQUEST_GAUGES)},
    }
    table = _metrics_table()
    assert {name: kind for name, (kind, _) in table.items()} == expected
    # the in-flight gauges come from the vLLM connector's Sender and Receiver only
    assert {name for name, (_, engines) in table.items() if engines == "vLLM"} >= {
        f"kvbridge_{name}" for name in REQUEST_GAUGES
    }


def test_the_package_has_docstring_examples_to_run() -> None:
    assert len(WITH_EXAMPLES) >= 20, WITH_EXAMPLES


@pytest.mark.parametrize("module", WITH_EXAMPLES)
def test_docstring_examples_run(module: str) -> None:
    """Every ``>>>`` example in the module's docstrings gives the output written under it
    (doctest prints a failing example's expected and actual output)."""
    failed, attempted = doctest.testmod(importlib.import_module(module), report=True)
    assert attempted > 0 and failed == 0, f"{failed} of {attempted} examples in {module} failed"
