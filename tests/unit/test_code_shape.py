"""The code stays readable: no module over 500 lines, no function over 80 lines, no exceptions.

The rule covers the package, the tests and the benchmarks alike: a test or a benchmark that nobody can read is as
hard to trust as package code.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS: tuple[str, ...] = ("eagle3_assets", "tests", "benchmarks")  # folders under REPO
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _offenders() -> list[str]:
    found = []
    for path in sorted(path for root in ROOTS for path in (REPO / root).rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        name = path.relative_to(REPO)
        if len(lines) > MAX_MODULE_LINES:
            found.append(f"{name}: {len(lines)} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{name}:{node.lineno} {node.name}(): {length} lines")
    return found


def test_no_module_or_function_is_too_long() -> None:
    assert _offenders() == []


def test_the_shape_check_sees_a_long_function(tmp_path: Path, monkeypatch) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
    (tmp_path / "eagle3_assets").mkdir()
    (tmp_path / "eagle3_assets" / "m.py").write_text(f"def f():\n{body}\n\n\n# a comment\ndef g():\n{body}\n")
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    assert [o.split(" ")[1] for o in _offenders()] == ["f():", "g():"]


def test_the_shape_check_covers_the_tests_and_the_benchmarks(tmp_path: Path, monkeypatch) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "unit" / "test_m.py").write_text(f"def test_h():\n{body}\n")
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "b.py").write_text("".join(f"x{i} = {i}\n" for i in range(MAX_MODULE_LINES + 1)))
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    assert _offenders() == [
        f"benchmarks/b.py: {MAX_MODULE_LINES + 1} lines",
        f"tests/unit/test_m.py:1 test_h(): {MAX_FUNCTION_LINES + 2} lines",
    ]
