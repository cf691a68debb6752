"""Issue 31, clause 11 (huge inputs): Dagster's real materialize() of raw_prompts, in a child process, streams the
dataset in bounded memory. Its peak resident memory (VmHWM) over a dataset four times larger grows only by what
it keeps per sample (id, line, content digest, prompt length), never with the rows' text; and a single line or
record far over the row limit is rejected (file, line, limit, remedy) without being read whole.

The same child at 10 GB: ``benchmarks/raw_prompts_memory.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import raw_prompts_memory

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.prompts import prompt_files

SMALL_BYTES, LARGE_BYTES = 20_000_000, 80_000_000
# What raw_prompts may keep per sample: ~260 bytes measured (two dict entries, the id, a 16-byte digest, the line,
# an 8-byte prompt length); generous, so that only memory growing with the text fails.
KEPT_BYTES_PER_ROW = 512
# Run-to-run noise of a peak: allocator and batch timing (the two peaks measured within 15 MB of each other).
NOISE_MB = 40
CHILD_TIMEOUT_S = 300
HUGE_ROW_BYTES = 320 * 2**20  # twenty times the default row limit (prompt_files.DEFAULT_MAX_ROW_BYTES)


@pytest.mark.slow
@pytest.mark.parametrize("kind", raw_prompts_memory.FORMATS)
def test_peak_memory_does_not_grow_with_the_dataset(tmp_path: Path, kind: str) -> None:
    runs = []
    for size in (SMALL_BYTES, LARGE_BYTES):
        dataset, rows = raw_prompts_memory.write_dataset(kind, tmp_path, size)
        out = raw_prompts_memory.measure(dataset, tmp_path / f"data-{size}", timeout_s=CHILD_TIMEOUT_S)
        dataset.unlink()  # the next dataset's disk
        assert out["success"] and out["rows_read"] == rows, out
        assert out["rows"] + out["rejects"] + out["duplicates"] == rows and out["duplicates"] > 0, out
        runs.append((rows, out))
    (small_rows, small), (large_rows, large) = runs
    allowed_mb = (large_rows - small_rows) * KEPT_BYTES_PER_ROW / 2**20 + NOISE_MB
    grown_mb = large["peak_mb"] - small["peak_mb"]
    text_mb = (LARGE_BYTES - SMALL_BYTES) / 2**20
    assert grown_mb <= allowed_mb, (
        f"{kind}: raw_prompts' peak memory grew {grown_mb:.0f} MB for {text_mb:.0f} MB more dataset "
        f"({large_rows - small_rows:,} more rows; allowed {allowed_mb:.0f} MB): {small} -> {large}"
    )


@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_an_oversized_row_is_rejected_without_being_read_whole(tmp_path: Path, kind: str) -> None:
    good = [json.dumps({"id": f"g{i}", "prompt": f"good question {i}"}) for i in range(40)]
    huge = '{"id": "huge", "prompt": "' + "x" * HUGE_ROW_BYTES + '"}'
    rows = [*good[:20], huge, *good[20:]]
    dataset = tmp_path / f"prompts.{kind}"
    dataset.write_text("\n".join(rows) + "\n" if kind == "jsonl" else "[" + ",\n".join(rows) + "]")
    data_dir = tmp_path / "data"

    out = raw_prompts_memory.measure(dataset, data_dir, timeout_s=CHILD_TIMEOUT_S)

    assert out["success"], out
    # Read whole, the row alone is 320 MB of bytes and again of text; skipped, it costs a few row limits (16 MB)
    # beside the run's own ~60 MB (Dagster's step, the metadata's plots).
    held_mb = out["peak_mb"] - out["baseline_mb"]
    assert held_mb < HUGE_ROW_BYTES / 2**20 / 2, out
    assert (out["rows"], out["rejects"]) == (40, 1), out
    (reject,) = [json.loads(line) for line in DataLayout.at(data_dir).rejects_path.read_text().splitlines()]
    what = "line 21" if kind == "jsonl" else "record 21"
    assert reject["line"] == 21 and f"{what} of {dataset} is {len(huge):,} bytes" in reject["reason"], reject
    assert f"above the limit of {prompt_files.DEFAULT_MAX_ROW_BYTES:,} bytes" in reject["reason"]
    assert "raise EAGLE3_MAX_PROMPT_CHARS" in reject["reason"]
