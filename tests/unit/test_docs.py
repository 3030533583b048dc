"""The documentation (README.md, the site under docs/) and the docstrings' examples stay
true to the code they document."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import msgspec
import pytest
import yaml

import kvbridge
from kvbridge.config import KVBridgeConfig, config_keys
from kvbridge.runtime.stats import COUNTERS, GAUGES, HISTOGRAMS, LIMIT_GAUGES, REQUEST_GAUGES

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
CONFIG_PAGE = DOCS / "user-guide" / "configuration.md"
METRICS_PAGE = DOCS / "user-guide" / "metrics.md"
README_MAX_LINES = 250
PACKAGE = Path(kvbridge.__file__).parent
WITH_EXAMPLES = sorted(
    ".".join(("kvbridge", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(
        ".__init__"
    )
    for path in PACKAGE.rglob("*.py")
    if ">>> " in path.read_text()
)


def test_the_config_page_documents_every_key_with_its_default() -> None:
    page = CONFIG_PAGE.read_text()
    defaults = msgspec.json.decode(msgspec.json.encode(KVBridgeConfig()))
    for key in config_keys():
        value = defaults
        for part in key.split("."):
            value = value[part]
        row = next((line for line in page.splitlines() if line.startswith(f"| `{key}` |")), None)
        assert row is not None, f"{CONFIG_PAGE.name}'s config table lacks {key}"
        shown = row.split("|")[2].strip().strip("`")
        assert msgspec.json.decode(shown) == value, (
            f"{CONFIG_PAGE.name} shows {key} = {shown}, code default is {value!r}"
        )


def _metrics_table() -> dict[str, tuple[str, str]]:
    """The metrics page's table: metric name -> (kind, engines)."""
    page = METRICS_PAGE.read_text()
    rows = [line.split("|") for line in page.splitlines() if line.startswith("| `kvbridge_")]
    return {row[1].strip().strip("`"): (row[2].strip(), row[3].strip()) for row in rows}


def test_the_metrics_page_lists_every_metric_with_its_kind() -> None:
    """Every metric the adapters export (the catalogues of :mod:`kvbridge.runtime.stats`)
    has a row of its kind in the metrics page's table, and the table names no other."""
    expected = {
        **{f"kvbridge_{name}_total": "counter" for name in COUNTERS},
        **{f"kvbridge_{name}": "histogram" for name, _ in HISTOGRAMS.values()},
        **{f"kvbridge_{name}": "gauge" for name in (*GAUGES, *REQUEST_GAUGES, *LIMIT_GAUGES)},
    }
    table = _metrics_table()
    assert {name: kind for name, (kind, _) in table.items()} == expected
    # the in-flight gauges come from the vLLM connector's Sender and Receiver only
    assert {name for name, (_, engines) in table.items() if engines == "vLLM"} >= {
        f"kvbridge_{name}" for name in REQUEST_GAUGES
    }


def test_readme_stays_a_front_page() -> None:
    """README.md is the short front page; the details live on the site under docs/."""
    lines = len(README.splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def _nav_pages(entries: object) -> list[str]:
    if isinstance(entries, str):
        return [entries]
    if isinstance(entries, list):
        return [page for entry in entries for page in _nav_pages(entry)]
    if isinstance(entries, dict):
        return [page for value in entries.values() for page in _nav_pages(value)]
    return []


def test_every_docs_page_is_in_the_nav() -> None:
    """``mkdocs build --strict`` (``make docs``, run by ``make test``) fails on this too;
    here it fails in the unit tests, without the docs extra installed."""
    # mkdocs.yml has no custom YAML tags, so the plain loader reads it
    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    pages = sorted(path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md"))
    assert pages, "no pages under docs/"
    assert sorted(set(nav)) == pages, {
        "missing from the nav": sorted(set(pages) - set(nav)),
        "in the nav, not in docs/": sorted(set(nav) - set(pages)),
    }


def test_the_package_has_docstring_examples_to_run() -> None:
    assert len(WITH_EXAMPLES) >= 20, WITH_EXAMPLES


@pytest.mark.parametrize("module", WITH_EXAMPLES)
def test_docstring_examples_run(module: str) -> None:
    """Every ``>>>`` example in the module's docstrings gives the output written under it
    (doctest prints a failing example's expected and actual output)."""
    failed, attempted = doctest.testmod(importlib.import_module(module), report=True)
    assert attempted > 0 and failed == 0, f"{failed} of {attempted} examples in {module} failed"
