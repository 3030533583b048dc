"""pytest plugin (``-p tier_times``, in pyproject's ``addopts``): how long each tier of the
suite took, printed at the end of the run, so the next person sees where the time goes.

A tier is a top folder of ``tests/`` (unit, conformance, vLLM engines, SGLang
components, SGLang engines, GPU); its time is the sum of its tests' setup, call and
teardown (module and session fixtures, i.e. engine starts, land on the test that first
needs them). With
``KVBRIDGE_TIER_LOG`` set, the figures are also appended to that file as JSON lines;
``python tests/support/tier_times.py FILE`` prints every run's figures together (what
``make test`` does at its end, after its pytest streams, which run side by side:
the wall clock printed is from the first start to the last end).

Also per test module: its time and the engine servers it started (every
:class:`kvbridge.demo.servers.ServerProcess` started while one of its tests ran), the
modules that cost most listed first; and how busy the machine's CPUs were over the run
(``/proc/stat``): well under 100 % means more could run side by side."""

from __future__ import annotations

import functools
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
    "integration_standin": "vLLM stand-in",
    "component_standin": "vLLM stand-in components",
}

_seconds: dict[str, float] = defaultdict(float)
_tests: dict[str, int] = defaultdict(int)
_module_seconds: dict[str, float] = defaultdict(float)
_module_starts: dict[str, int] = defaultdict(int)
_current = {"module": "(outside tests)"}
_started = time.monotonic()
_started_at = time.time()


@functools.cache
def _standin() -> str | None:
    """``vLLM <release> stand-in`` when the vLLM servers of this run are stand-ins
    (``KVBRIDGE_VLLM_STANDIN=1``: the tier of ``tests/integration_standin``, and of the
    ``tests/integration`` modules that scripts/test.sh runs there too), else None."""
    if os.environ.get("KVBRIDGE_VLLM_STANDIN") != "1":
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"vLLM {version('vllm')} stand-in"
    except PackageNotFoundError:
        return "vLLM stand-in"


def _tier(nodeid: str) -> str:
    parts = nodeid.split("/")
    folder = parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]
    if folder in ("integration", "integration_standin") and _standin():
        return _standin()  # one environment per vLLM release: say which
    if folder == "component_standin" and _standin():
        return f"{_standin()} components"
    return TIERS.get(folder, folder)


def _module(nodeid: str) -> str:
    """The test's module; an engine module run with stand-ins says so (its name is
    also the real engine's module of the other stream)."""
    module = nodeid.split("::", 1)[0]
    if module.startswith("tests/integration/") and _standin():
        return f"{module} ({_standin()})"
    return module


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot; None off Linux."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


_cpu_at_start = _cpu_times()


def pytest_configure(config) -> None:
    """Count engine servers per module: wrap ``ServerProcess.start`` (when kvbridge's
    demo servers import here; the GPU and unit tiers need none)."""
    try:
        from kvbridge.demo.servers import ServerProcess
    except ImportError:
        return
    if getattr(ServerProcess.start, "_tier_counted", False):
        return
    start = ServerProcess.start

    def counted_start(self, *args, **kwargs):
        _module_starts[_current["module"]] += 1
        return start(self, *args, **kwargs)

    counted_start._tier_counted = True
    ServerProcess.start = counted_start


def pytest_runtest_logstart(nodeid: str, location) -> None:
    _current["module"] = _module(nodeid)


def pytest_runtest_logreport(report) -> None:
    tier = _tier(report.nodeid)
    _seconds[tier] += report.duration
    _module_seconds[_module(report.nodeid)] += report.duration
    if report.when == "call" or (report.when == "setup" and report.skipped):
        _tests[tier] += 1


def _table(rows: list[tuple[str, int, float]], wall: float | None = None) -> str:
    lines = [f"{'tier':<16}{'tests':>7}{'minutes':>10}"]
    lines += [f"{tier:<16}{n:>7}{s / 60:>10.1f}" for tier, n, s in rows]
    if wall is not None:
        lines.append(f"{'(wall clock)':<16}{'':>7}{wall / 60:>10.1f}")
    return "\n".join(lines)


MODULES_SHOWN = 12


def _modules_table(rows: list[tuple[str, float, int]]) -> str:
    lines = [f"{'module':<66}{'minutes':>9}{'servers':>9}"]
    lines += [f"{m[-66:]:<66}{s / 60:>9.1f}{n:>9}" for m, s, n in rows]
    return "\n".join(lines)


def _busy_share() -> float | None:
    end = _cpu_times()
    if _cpu_at_start is None or end is None or end[1] == _cpu_at_start[1]:
        return None
    return (end[0] - _cpu_at_start[0]) / (end[1] - _cpu_at_start[1])


def pytest_terminal_summary(terminalreporter) -> None:
    if not _seconds:
        return
    wall = time.monotonic() - _started
    rows = [(t, _tests[t], _seconds[t]) for t in sorted(_seconds, key=lambda t: -_seconds[t])]
    terminalreporter.write_sep("-", "time per tier")
    terminalreporter.write_line(_table(rows, wall))
    modules = sorted(
        ((m, s, _module_starts.get(m, 0)) for m, s in _module_seconds.items()),
        key=lambda r: -r[1],
    )
    busy = _busy_share()
    log = os.environ.get("KVBRIDGE_TIER_LOG")
    if log:
        records = [{"tier": t, "tests": n, "seconds": round(s, 1)} for t, n, s in rows]
        records += [
            {"module": m, "seconds": round(s, 1), "servers": n}
            for m, s, n in modules[:MODULES_SHOWN]
        ]
        records.append(
            {
                "tier": "(wall clock)",
                "tests": 0,
                "seconds": round(wall, 1),
                "start": round(_started_at, 1),
                "end": round(time.time(), 1),
                "cpu_busy": None if busy is None else round(busy, 3),
            }
        )
        with Path(log).open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    else:  # one process: print its modules here (make test prints both streams' at the end)
        terminalreporter.write_line(_modules_table(modules[:MODULES_SHOWN]))


def main(path: str) -> int:
    """Print the tiers of every run logged in ``path`` (``make test``'s last step)."""
    rows: list[tuple[str, int, float]] = []
    modules: list[tuple[str, float, int]] = []
    spans: list[tuple[float, float]] = []
    busy: list[tuple[float, float | None]] = []  # (span, CPU busy share) per stream
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        if "module" in r:
            modules.append((r["module"], r["seconds"], r["servers"]))
        elif r["tier"] == "(wall clock)":
            spans.append((r["start"], r["end"]))
            busy.append((r["end"] - r["start"], r.get("cpu_busy")))
        else:
            rows.append((r["tier"], r["tests"], r["seconds"]))
    merged: dict[str, tuple[int, float]] = {}  # a tier split over streams counts once
    for tier, n, seconds in rows:
        m = merged.get(tier, (0, 0.0))
        merged[tier] = (m[0] + n, m[1] + seconds)
    rows = sorted(((t, n, sec) for t, (n, sec) in merged.items()), key=lambda r: -r[2])
    wall = max(end for _, end in spans) - min(start for start, _ in spans) if spans else 0.0
    print("time per tier, this make test (tiers of the streams overlap in time):")
    print(_table(rows, wall))
    modules.sort(key=lambda r: -r[1])
    print(f"\nthe {MODULES_SHOWN} slowest modules, and the engine servers each started:")
    print(_modules_table(modules[:MODULES_SHOWN]))
    longest = max(busy, default=(0.0, None))[1]
    if longest is not None:
        print(f"\nthe machine's CPUs were {longest:.0%} busy over the longest stream")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
