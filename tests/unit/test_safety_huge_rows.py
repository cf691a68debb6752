"""Issue 31, clause 11 (huge inputs), the readers' side: a row longer than the row limit is rejected with the file,
its line or record number, the limit and the remedy, and skipped without being held; the rows around it are
unaffected, whatever the chunk boundaries. (The memory of the whole raw_prompts run, in a real child process:
tests/integration/test_safety_huge_inputs.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.prompts import prompt_files
from eagle3_assets.prompts.conversations import load_prompts
from eagle3_assets.prompts.prompt_files import DatasetCutError, JsonArrayRows
from eagle3_assets.prompts.prompt_table import build_prompt_table

LIMIT = 120  # bytes: small, so that an oversized row costs nothing to write


def _good(i: int) -> dict:
    return {"id": f"g{i}", "prompt": f"question {i}"}


# Oversized values that a naive scanner would end in the wrong place: brackets and quotes inside strings, escapes
# (an escaped quote, an escaped backslash before a quote), nesting, a bare long string and a long number.
OVERSIZED = [
    {"id": "big-1", "prompt": "x" * 300},
    {"id": "big-2", "prompt": 'tricky ] } [ { \\" \\\\' * 20 + '"\\', "nested": [[{"a": ["]"]}]] * 10},
    "a bare string record, much longer than the limit: " + "\u00e9\U0001f642" * 100,
    int("9" * 200),
]


def _oversized_reason(reason: str | None, path: Path, what: str) -> None:
    assert reason is not None
    assert f"{what} of {path} is " in reason, reason
    assert f"above the limit of {LIMIT:,} bytes for one row" in reason
    assert "raise EAGLE3_MAX_PROMPT_CHARS" in reason


@pytest.mark.parametrize("chunk_chars", [1, 2, 3, 7, 64, 1 << 20])
def test_an_oversized_array_record_is_rejected_and_the_next_records_are_intact(
    tmp_path: Path, chunk_chars: int
) -> None:
    records: list = []
    for i, big in enumerate(OVERSIZED):
        records += [_good(i), big]
    records.append(_good(99))
    path = tmp_path / "a.json"
    path.write_text(json.dumps(records, indent=1, ensure_ascii=False), encoding="utf-8")
    rows = list(JsonArrayRows(path, chunk_chars=chunk_chars, max_row_bytes=LIMIT))
    assert [number for number, _, _, _ in rows] == list(range(1, len(records) + 1))
    for (number, row, raw, error), record in zip(rows, records, strict=True):
        if record in OVERSIZED:
            assert row is None and raw  # the snippet's bytes, never the record
            _oversized_reason(error, path, f"record {number}")
            size = len(json.dumps(record, indent=1, ensure_ascii=False).replace("\n", "\n ").encode())
            assert f" is {size:,} bytes" in error  # the record's exact size, found by the skipping scanner
        else:
            assert (row, error) == (record, None)


@pytest.mark.parametrize("chunk_chars", [1, 5, 1 << 20])
def test_an_array_cut_inside_an_oversized_record_names_where_that_record_starts(
    tmp_path: Path, chunk_chars: int
) -> None:
    data = json.dumps([_good(0), _good(1), {"id": "big", "prompt": "y" * 500}]).encode()
    cut_at = len(data) - 100
    path = tmp_path / "cut.json"
    path.write_bytes(data[:cut_at])
    with pytest.raises(DatasetCutError) as raised:
        list(JsonArrayRows(path, chunk_chars=chunk_chars, max_row_bytes=LIMIT))
    cut = raised.value.cut
    assert (cut.complete_records, cut.byte_offset) == (2, cut_at)
    assert cut.record_start == data.index(b'{"id": "big"') and "the file ends inside record 3" in cut.problem


def test_jsonl_line_limit_is_exact_and_a_long_line_is_skipped_in_bounded_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def line(i: int, length: int) -> bytes:
        text = json.dumps({"id": f"l{i}", "prompt": ""})
        return (text[:-2] + "z" * (length - len(text)) + text[-2:]).encode()

    lines = [line(1, LIMIT), line(2, LIMIT + 1), line(3, 10 * LIMIT), line(4, 20), line(5, LIMIT + 1)]
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n".join(lines))  # the last line ends the file without a newline
    monkeypatch.setattr(prompt_files, "READ_BLOCK_BYTES", 7)  # the rest of a long line is read past in small reads
    rows = list(prompt_files.jsonl_rows(path, max_row_bytes=LIMIT))
    assert [number for number, *_ in rows] == [1, 2, 3, 4, 5]
    assert rows[0][1]["id"] == "l1" and rows[3][1]["id"] == "l4"  # exactly the limit is allowed
    for number, row, raw, error in (rows[1], rows[2], rows[4]):
        assert row is None and len(raw) <= prompt_files.SNIPPET_BYTES
        _oversized_reason(error, path, f"line {number}")
        assert f" is {len(lines[number - 1]):,} bytes" in error  # the newline not counted


def test_the_row_limit_follows_max_prompt_chars_and_rejects_reach_the_table(tmp_path: Path) -> None:
    assert prompt_files.max_row_bytes(1_000) == prompt_files.DEFAULT_MAX_ROW_BYTES  # a floor for short prompts
    assert prompt_files.max_row_bytes(10_000_000) == prompt_files.ROW_BYTES_PER_PROMPT_CHAR * 10_000_000
    big = {"id": "big", "prompt": "w" * (prompt_files.DEFAULT_MAX_ROW_BYTES + 10)}
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [_good(0), big, _good(1)]) + "\n")
    layout = DataLayout.at(tmp_path / "data")
    result = build_prompt_table(path, layout, partition_size=10, max_reject_share=0.5)
    assert (result.rows, result.rejects) == (2, 1)
    (reject,) = [json.loads(line) for line in layout.rejects_path.read_text().splitlines()]
    assert reject["line"] == 2 and f"line 2 of {path} is " in reject["reason"]
    assert "raise EAGLE3_MAX_PROMPT_CHARS" in reject["reason"] and len(reject["snippet"]) <= 200
    # raising EAGLE3_MAX_PROMPT_CHARS raises the row limit: the same row is then read (and judged by its prompt)
    assert [p.sample_id for p in load_prompts(path, max_prompt_chars=2 * len(big["prompt"])).prompts] == [
        "g0",
        "big",
        "g1",
    ]
