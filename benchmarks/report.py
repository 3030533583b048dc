"""Markdown for the committed reports (``<routine>.md``)."""

from __future__ import annotations


def md_table(head: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    """A Markdown table's lines: the first ``left`` columns left-aligned, the others
    right-aligned (numbers)."""
    return [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * left + "---:|" * (len(head) - left),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def measured_on(machine: dict) -> str:
    """A report's opening words: when and on what it was measured (``machine``: the
    report's ``machine`` entry)."""
    return f"Measured {machine['date']} on {machine['cpus']} CPUs ({machine['platform']})"


def md_report(intro: str, head: list[str], rows: list[list[str]], left: int = 1) -> str:
    """A report: the ``intro`` paragraph, then the table (:func:`md_table`)."""
    return "\n".join([intro, "", *md_table(head, rows, left)]) + "\n"
