"""Reading the evaluation report's Markdown table (``EvaluationReport.markdown``, the ``eagle3 evaluate`` table)."""

from __future__ import annotations


def table_row(markdown: str, prompt_set: str, draft: str) -> list[str]:
    """The cells of the first table row whose first two cells are ``prompt_set`` and ``draft`` (the header's are
    "prompt set" and "draft")."""
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) > 2 and cells[0] == prompt_set and cells[1] == draft:
            return cells
    raise AssertionError(f"no {prompt_set!r} {draft!r} row in:\n{markdown}")
