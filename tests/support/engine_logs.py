"""What a failed engine test reports from the engines' logs (every ``*.log`` under the
session's base temp dir). CI keeps only the tail of the console output: the short
summary line of a failure must carry the reason an engine gave, not only the HTTP 500
the client saw."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

_FAILED = re.compile(r"kvbridge: .*(failed|expired|lost|refused|gave up).*")
"""A kvbridge warning that explains a failed request (a transfer that failed or whose
lease expired, a peer lost or refusing)."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """The engine suites' hook (their conftests import it): on a failure (test or
    fixture), report what the engine logs say."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        attach_engine_logs(item, report, since=call.start)


def attach_engine_logs(
    item: pytest.Item, report: pytest.TestReport, since: float, reasons: int = 4
) -> None:
    """For a failed report: attaches the recent errors of every engine log as report
    sections, and appends the last ``reasons`` kvbridge failure lines of the logs
    written since ``since`` (the failed phase's start, epoch seconds), each with its
    log's name, to the failure's message, which the short summary prints."""
    base: Path = item.config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    found: list[str] = []
    for log in sorted(base.rglob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        hits = [
            i
            for i, line in enumerate(lines)
            if "Traceback" in line or "ERROR" in line or ("kvbridge" in line and "WARNING" in line)
        ]
        if hits:
            last = hits[-1]
            report.sections.append(
                (
                    f"engine log {log.relative_to(base)}",
                    "\n".join(lines[max(0, last - 120) : last + 30]),
                )
            )
        if log.stat().st_mtime >= since:
            found += [f"{log.stem}: {m.group(0)}" for line in lines if (m := _FAILED.search(line))]
    crash = getattr(report.longrepr, "reprcrash", None)
    if found and crash is not None:
        crash.message += "\n[engine logs] " + "\n[engine logs] ".join(found[-reasons:])
