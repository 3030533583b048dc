"""MkDocs hook (``mkdocs.yml``: ``hooks``): serve the committed benchmark plots.

MkDocs serves only files under ``docs/``; the plots live in ``benchmarks/results/``, where
``benchmarks/run.py`` writes them beside the reports that ``tests/unit/test_sources.py``
checks. Rather than commit copies, each ``benchmarks/results/**/*.png`` is added to the
site as ``benchmarks/img/<path>``, so a page under ``docs/benchmarks/`` links
``img/serving.png`` or ``img/packed/serving.png``.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def on_files(files: Files, config, **_) -> Files:
    for png in sorted(RESULTS.rglob("*.png")):
        uri = "benchmarks/img/" + png.relative_to(RESULTS).as_posix()
        files.append(File.generated(config, uri, abs_src_path=str(png)))
    return files
