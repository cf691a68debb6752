"""Issue 8, bad data: property-based tests feed the prompt loader random and adversarial JSONL lines. It never
crashes, and every non-blank line ends accepted, rejected with a reason, or counted as a duplicate. (Hand-picked
malformed rows: tests/unit/test_prompts.py::test_malformed_row_is_rejected_with_reason_and_good_rows_survive.)"""

from __future__ import annotations

import codecs
import json
import tempfile
from pathlib import Path

import polars as pl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.prompts.conversations import load_prompts
from eagle3_assets.prompts.prompt_table import build_prompt_table

# JSON values of every type, nested a little
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
adversarial_text = st.one_of(
    st.text(max_size=50),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=50),
    st.sampled_from(["", "   ", "\x00", "a\x00b", "\ud800", "\udfff lone", "\ufeff", "\u2028", "\r", "\t\n"]),
    st.integers(0, 2_000_000).map(lambda n: "x" * n),  # up to twice the default max_prompt_chars
)
roles = st.sampled_from(["system", "user", "assistant", "human", "gpt", "tool", "", "USER", "GPT"]) | st.text(
    max_size=8
)
turn = st.fixed_dictionaries(
    {},
    optional={
        "role": roles | json_values,
        "content": adversarial_text | json_values,
        "from": roles | json_values,
        "value": adversarial_text | json_values,
    },
)
row = st.fixed_dictionaries(
    {},
    optional={
        "id": st.text(max_size=300) | st.integers() | json_values,
        "messages": st.lists(turn, max_size=4) | json_values,
        "conversations": st.lists(turn, max_size=4) | json_values,
        "prompt": adversarial_text | json_values,
    },
)


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


json_lines = st.one_of(
    row.map(lambda r: json.dumps(r, ensure_ascii=False).encode("utf-8", "surrogatepass")),
    row.map(lambda r: json.dumps(r).encode()),  # \\ud800 escapes: lone surrogates after decoding
    json_values.map(lambda v: json.dumps(v).encode()),
    st.integers(1, 200_000).map(lambda d: _deep(d).encode()),  # deep nesting, up to far past the recursion limit
    st.integers(1, 3000).map(lambda d: ('{"prompt": ' + '{"a": ' * d + "1" + "}" * d + "}").encode()),
    st.binary(max_size=200).map(lambda b: b.replace(b"\n", b" ")),  # random bytes, invalid UTF-8, NUL
    st.sampled_from(
        [
            b'\xef\xbb\xbf{"prompt": "bom"}',
            b'{"prompt": "a"}\x00',
            b"NaN",
            b"1e999",
            b'{"prompt": "' + b"9" * 5000 + b'"}',
            b'{"id": ' + b"9" * 5000 + b', "prompt": "x"}',
            b'"just a string"',
            b'{"prompt": "ok", "prompt": 5}',
        ]
    ),
)
# Duplicates on purpose: sometimes repeat an earlier line
datasets = st.lists(json_lines, min_size=1, max_size=12).flatmap(
    lambda lines: st.lists(st.sampled_from(lines), max_size=3).map(lambda extra: lines + extra)
)


def _write(folder: Path, lines: list[bytes]) -> Path:
    path = folder / "prompts.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def _non_blank(lines: list[bytes]) -> int:
    # A UTF-8 byte-order mark opening the file is not part of the first row (a line holding only that is blank).
    first = [lines[0].removeprefix(codecs.BOM_UTF8), *lines[1:]] if lines else []
    return sum(1 for line in first if line.strip())


def _fuzz(max_examples: int) -> settings:
    # large generated datasets trip the speed and size health checks; no example database: each run draws afresh
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@_fuzz(max_examples=200)
@given(datasets)
def test_loader_never_crashes_and_accounts_for_every_line(lines: list[bytes]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        loaded = load_prompts(_write(Path(folder), lines))
    assert loaded.rows_read == _non_blank(lines)
    assert len(loaded.prompts) + len(loaded.rejects) + loaded.duplicates == loaded.rows_read
    for reject in loaded.rejects:
        assert reject.reason.strip() and 1 <= reject.line <= len(lines)
        json.dumps(reject.reason, ensure_ascii=False).encode()  # storable as UTF-8
        json.dumps(reject.snippet, ensure_ascii=False).encode()
    ids = [p.sample_id for p in loaded.prompts]
    assert len(ids) == len(set(ids))
    for prompt in loaded.prompts:
        assert prompt.messages and prompt.messages[-1][0] == "user"
        for role, content in prompt.messages:
            assert role in {"system", "user", "assistant"}
            assert content.strip() and "\x00" not in content
            content.encode("utf-8")  # no lone surrogates reach the table


@_fuzz(max_examples=40)
@given(datasets)
def test_prompt_table_is_written_for_any_dataset_or_refused_with_a_reason(lines: list[bytes]) -> None:
    """build_prompt_table (the raw_prompts asset's core) writes readable files or raises a clear refusal."""
    with tempfile.TemporaryDirectory() as folder:
        layout = DataLayout.at(Path(folder) / "data")
        path = _write(Path(folder), lines)
        try:
            result = build_prompt_table(path, layout, partition_size=5, max_reject_share=1.0)
        except ValueError as error:  # no rows at all
            assert "has no rows" in str(error)
            return
        table = pl.read_parquet(layout.prompts_path)
        assert table.height == result.rows == result.rows_read - result.rejects - result.duplicates
        rejects = [json.loads(line) for line in layout.rejects_path.read_bytes().split(b"\n") if line]
        assert len(rejects) == result.rejects and all(r["reason"] for r in rejects)


def test_utf8_byte_order_mark_does_not_cost_the_first_row(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"id": "first", "prompt": "hello"}\n{"id": "second", "prompt": "world"}\n')
    loaded = load_prompts(path)
    assert [p.sample_id for p in loaded.prompts] == ["first", "second"] and not loaded.rejects
