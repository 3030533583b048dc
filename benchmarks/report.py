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
