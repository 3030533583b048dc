"""Whole-repository checks that no single module's tests make: every Python file compiles
without warnings, and the committed benchmark reports are what the report code renders
from the committed results."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(
    path
    for top in ("src", "tests", "benchmarks", "scripts", "examples")
    for path in (ROOT / top).rglob("*.py")
    if "__pycache__" not in path.parts
)
RESULTS = ROOT / "benchmarks" / "results"
# saved runs with a committed Markdown report (ops_variants.json is raw data only)
REPORTS = sorted(p for p in RESULTS.rglob("*.json") if p.with_suffix(".md").exists())


def test_there_are_sources_and_reports_to_check() -> None:
    assert len(SOURCES) > 150 and (ROOT / "src/kvbridge/config.py") in SOURCES
    assert (RESULTS / "transfer.json") in REPORTS


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_compiles_without_warnings(path: Path) -> None:
    """A SyntaxWarning ("'str' object is not callable; perhaps you missed a comma?", an
    invalid escape) is a bug Python only reports; here it fails."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compile(path.read_text(), str(path), "exec")


@pytest.mark.parametrize("saved", REPORTS, ids=lambda p: str(p.relative_to(RESULTS)))
def test_committed_report_is_what_its_results_render_to(saved: Path, tmp_path: Path) -> None:
    """``benchmarks/run.py ROUTINE --from-json`` re-renders a saved run: its Markdown must
    equal the committed one (the benchmark pages under docs/ include these), so report
    code that breaks or drifts from the committed numbers fails here, without running a
    benchmark."""
    routine = saved.stem
    committed = saved.with_suffix(".md")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "run.py"),
            routine,
            "--from-json",
            str(saved),
            "--out",
            str(tmp_path),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert (tmp_path / f"{routine}.md").read_text() == committed.read_text()
    assert (tmp_path / f"{routine}.png").stat().st_size > 0
