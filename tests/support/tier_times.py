"""pytest plugin (``-p tier_times``, in pyproject's ``addopts``): how long each tier of the
suite took, printed at the end of the run, so the next person sees where the time goes.

A tier is a top folder of ``tests/`` (unit, conformance, vLLM engines, SGLang
components, SGLang engines, GPU); its time is the sum of its tests' setup, call and
teardown (module and session fixtures, i.e. engine starts, land on the test that first
needs them). With
``KVBRIDGE_TIER_LOG`` set, the figures are also appended to that file as JSON lines;
``python tests/support/tier_times.py FILE`` prints every run's figures together (what
``make test`` does at its end, after its two pytest processes, which run side by side:
the wall clock printed is from the first start to the last end)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

TIERS = {
    "unit": "unit",
    "conformance": "conformance",
    "integration": "vLLM engines",
    "component_sglang": "SGLang components",
    "integration_sglang": "SGLang engines",
    "gpu": "GPU",
}

_seconds: dict[str, float] = defaultdict(float)
_tests: dict[str, int] = defaultdict(int)
_started = time.monotonic()
_started_at = time.time()


def _tier(nodeid: str) -> str:
    parts = nodeid.split("/")
    folder = parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]
    return TIERS.get(folder, folder)


def pytest_runtest_logreport(report) -> None:
    tier = _tier(report.nodeid)
    _seconds[tier] += report.duration
    if report.when == "call" or (report.when == "setup" and report.skipped):
        _tests[tier] += 1


def _table(rows: list[tuple[str, int, float]], wall: float | None = None) -> str:
    lines = [f"{'tier':<16}{'tests':>7}{'minutes':>10}"]
    lines += [f"{tier:<16}{n:>7}{s / 60:>10.1f}" for tier, n, s in rows]
    if wall is not None:
        lines.append(f"{'(wall clock)':<16}{'':>7}{wall / 60:>10.1f}")
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter) -> None:
    if not _seconds:
        return
    wall = time.monotonic() - _started
    rows = [(t, _tests[t], _seconds[t]) for t in sorted(_seconds, key=lambda t: -_seconds[t])]
    terminalreporter.write_sep("-", "time per tier")
    terminalreporter.write_line(_table(rows, wall))
    log = os.environ.get("KVBRIDGE_TIER_LOG")
    if log:
        records = [{"tier": t, "tests": n, "seconds": round(s, 1)} for t, n, s in rows]
        records.append(
            {
                "tier": "(wall clock)",
                "tests": 0,
                "seconds": round(wall, 1),
                "start": round(_started_at, 1),
                "end": round(time.time(), 1),
            }
        )
        with Path(log).open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)


def main(path: str) -> int:
    """Print the tiers of every run logged in ``path`` (``make test``'s last step)."""
    rows: list[tuple[str, int, float]] = []
    spans: list[tuple[float, float]] = []
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        if r["tier"] == "(wall clock)":
            spans.append((r["start"], r["end"]))
        else:
            rows.append((r["tier"], r["tests"], r["seconds"]))
    wall = max(end for _, end in spans) - min(start for start, _ in spans) if spans else 0.0
    print("time per tier, this make test (tiers of the two streams overlap in time):")
    print(_table(rows, wall))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
