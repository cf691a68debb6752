"""Every figure a table in README.md or docs/ quotes comes from a measurement file (issue 32 item 1).

The convention: a table holding numbers has a comment on the line above it (blank lines between allowed),

    <!-- figures: measurements/demo_real_f7d102c.txt measurements/engine_ratio_9f26823.jsonl -->
    <!-- figures: none (what the table holds instead: settings, limits, a fault matrix) -->
    <!-- figures: unbacked (why: measured before measurement files were kept) -->

paths relative to docs/ (README.md's too). A table inside a fenced code block (a command's output quoted as
printed) takes its marker from the line above the fence: a comment inside the fence would be shown as part of the
output. With files named, every number in the table's body must be one those files hold: the same value at the
table's precision (1.477 matches 1.4766 in a JSON; 97% matches 0.97 or 97), so a figure edited by hand, or copied
from another run, fails. ``unbacked`` tables are counted and may not grow beyond
:data:`UNBACKED_LIMIT`: old figures get a file or leave, none are added.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from eagle3_assets.operations.measurement_tables import main, rerendered

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MARKER = re.compile(r"<!--\s*figures:\s*(.*?)\s*-->")
NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?%?")
UNBACKED_LIMIT = 12  # the tables measured before measurement files were kept, at the time of this test


@dataclass
class Table:
    path: Path
    line: int  # 1-based line of the table's header
    marker: str | None
    body: list[str]


def _marker_above(lines: list[str], i: int) -> re.Match[str] | None:
    """The marker on the first non-blank line above line ``i`` (0-based), if that line holds one."""
    j = i - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    return MARKER.search(lines[j]) if j >= 0 else None


def tables(path: Path) -> list[Table]:
    lines = path.read_text().splitlines()
    found = []
    fence: int | None = None  # 0-based line of the open fence of a fenced code block, if inside one
    i = 0
    while i < len(lines):
        if lines[i].lstrip().startswith(("```", "~~~")):
            fence = i if fence is None else None
            i += 1
        elif lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|\s*:?-{3,}", lines[i + 1]):
            marker = _marker_above(lines, i)
            if marker is None and fence is not None:
                marker = _marker_above(lines, fence)
            end = i + 2
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            found.append(Table(path, i + 1, marker.group(1) if marker else None, lines[i + 2 : end]))
            i = end
        else:
            i += 1
    return found


def numbers(text: str) -> list[str]:
    return NUMBER.findall(text)


def _value(token: str) -> float:
    return float(token.rstrip("%").replace(",", ""))


def held(token: str, values: list[float]) -> bool:
    """Whether a measurement file holds the table's figure ``token`` at the table's precision."""
    digits = len(token.rstrip("%").partition(".")[2])
    wanted = _value(token)
    scales = (1.0, 100.0) if token.endswith("%") else (1.0,)
    return any(abs(round(x * scale, digits) - wanted) < 1e-9 for x in values for scale in scales)


def source_values(table: Table) -> list[float]:
    values: list[float] = []
    for name in table.marker.split() if table.marker else []:
        source = (DOCS / name).resolve()
        assert source.is_file(), f"{table.path.name}:{table.line}: the figures' file {name} does not exist"
        values += [_value(t) for t in numbers(source.read_text())]
    return values


def problems(table: Table) -> list[str]:
    """What is wrong with one table: an unmarked table of numbers, or figures its files do not hold."""
    where = f"{table.path.relative_to(ROOT)}:{table.line}"
    cells = [cell for row in table.body for cell in row.strip("|").split("|")]
    figures = [token for cell in cells for token in numbers(cell)]
    if not figures:
        return []
    if table.marker is None:
        return [f"{where}: a table of numbers with no `<!-- figures: ... -->` line above it"]
    if table.marker.startswith(("none", "unbacked")):
        return []
    values = source_values(table)
    missing = sorted({token for token in figures if not held(token, values)})
    return [f"{where}: {', '.join(missing)} in no file of `{table.marker}`"] if missing else []


def every_table() -> list[Table]:
    return [t for path in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))] for t in tables(path)]


def test_every_figure_in_a_table_comes_from_a_measurement_file() -> None:
    wrong = [problem for table in every_table() for problem in problems(table)]
    assert not wrong, "\n".join(wrong)


def test_unbacked_tables_do_not_grow() -> None:
    unbacked = [f"{t.path.name}:{t.line}" for t in every_table() if (t.marker or "").startswith("unbacked")]
    assert len(unbacked) <= UNBACKED_LIMIT, unbacked


def test_a_figure_edited_by_hand_fails(tmp_path: Path) -> None:
    source = DOCS / "measurements" / "scratch_for_test.txt"
    doc = tmp_path / "doc.md"
    try:
        source.write_text("mean acceptance length 1.4766, speed-up 1.08, 248 rows, share 0.97\n")
        doc.write_text(
            "<!-- figures: measurements/scratch_for_test.txt -->\n\n"
            "| set | acc. len | speed-up | rows | full |\n|---|---|---|---|---|\n"
            "| held-out | 1.477 | 1.08 | 248 | 97% |\n"
        )
        (table,) = tables(doc)
        table.path = ROOT / "docs" / "doc.md"  # where it would live
        assert problems(table) == []
        table.body = [table.body[0].replace("1.477", "1.487")]
        assert problems(table) == ["docs/doc.md:3: 1.487 in no file of `measurements/scratch_for_test.txt`"]
        table.marker = None
        assert "no `<!-- figures: ... -->` line" in problems(table)[0]
    finally:
        source.unlink(missing_ok=True)


def test_a_table_in_a_fenced_block_takes_the_marker_above_the_fence(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "As printed:\n\n<!-- figures: measurements/run.txt -->\n\n```\nstage seconds\n\n"
        "| set | speed-up |\n|---|---|\n| held-out | 1.08 |\n```\n\n"
        "| outside | 2 |\n|---|---|\n| row | 3 |\n"
    )
    inside, outside = tables(doc)
    assert (inside.marker, inside.body) == ("measurements/run.txt", ["| held-out | 1.08 |"])
    assert outside.marker is None  # the fence's marker does not reach past its closing fence


@pytest.mark.parametrize(
    "token,values,expected",
    [("1.72", [1.7201], True), ("97%", [0.97], True), ("1,128,852", [1128852.0], True), ("0.98", [0.97], False)],
)
def test_precision_matching(token: str, values: list[float], expected: bool) -> None:
    assert held(token, values) is expected


# ------------------------------------------------------------------ tables rendered from a measurement file


def test_every_rendered_table_is_what_its_file_renders() -> None:
    """``eagle3 tables --check`` over README.md and docs/: a rendered block edited by hand, or a file re-measured
    without re-rendering, fails (``eagle3 tables README.md docs/*.md`` redraws them)."""
    paths = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    stale = [f"{path.name}: {block}" for path in paths for block in rerendered(path.read_text())[1]]
    assert not stale, "run `eagle3 tables README.md docs/*.md`: " + "; ".join(stale)


def test_a_rendered_table_is_redrawn_and_a_hand_edit_is_seen(tmp_path: Path) -> None:
    run = {
        "run": "demo", "commit": "abc1234", "stages": [
            {"stage": "synthetic_responses", "partitions": "3", "seconds": 136.9, "server_fullness": {
                "mean_running": 57.93, "mean_waiting": 0.0, "target": 64, "share": 0.905}},
            {"stage": "draft_model", "partitions": "-", "seconds": 425.1},
        ],
    }  # fmt: skip
    (tmp_path / "run.json").write_text(json.dumps(run))
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Before.\n\n<!-- figures: run.json --><!-- rendered: stages -->\n| old |\n<!-- end rendered -->\nAfter.\n"
    )
    assert main([str(doc), "--docs", str(tmp_path)]) == 0  # redrawn
    assert main([str(doc), "--docs", str(tmp_path), "--check"]) == 0  # then current
    text = doc.read_text()
    assert "| synthetic_responses | 3 | 136.9 | 57.9 of 64 running (90%), 0.0 waiting |" in text
    assert text.startswith("Before.\n\n") and text.endswith("<!-- end rendered -->\nAfter.\n")
    (table,) = tables(doc)
    assert table.marker == "run.json"  # the block's first line is the table's figures marker too
    doc.write_text(text.replace("425.1", "325.1"))
    assert rerendered(doc.read_text(), tmp_path)[1] == ["run.json stages"]
    assert main([str(doc), "--docs", str(tmp_path), "--check"]) == 1
