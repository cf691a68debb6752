"""Imports sit at the top of a module unless a ``# lazy:`` comment says why not (a heavy library only one path needs,
a test replacing the name, a process boundary), and their number does not grow.

An in-function import is excused by a ``# lazy:`` comment on its own line or on the line above it; a run of imports
under one such comment shares it. ``MAX_LAZY_IMPORTS`` is today's count: lower it when you hoist one.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "eagle3_assets"
MAX_LAZY_IMPORTS = (
    203  # 383 before the restructure (issue 34); every one left loads a heavy library or is replaced by a test
)


def lazy_imports(root: Path = PACKAGE) -> list[tuple[str, int, bool]]:
    """(file, line, excused) of every import inside a function."""
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        nodes = {
            node
            for fn in ast.walk(ast.parse("\n".join(lines)))
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
            for node in ast.walk(fn)
            if isinstance(node, ast.Import | ast.ImportFrom)
        }
        covered = {line for node in nodes for line in range(node.lineno, (node.end_lineno or node.lineno) + 1)}
        for node in sorted(nodes, key=lambda n: n.lineno):
            excused = "# lazy:" in lines[node.lineno - 1]
            above = node.lineno - 1
            while not excused and above >= 1:
                text = lines[above - 1].strip()
                if text.startswith("# lazy:"):
                    excused = True
                elif text.startswith("#") or above in covered:
                    above -= 1  # another import of the same run, or a comment
                    continue
                break
            found.append((str(path.relative_to(root.parent)), node.lineno, excused))
    return found


def test_every_lazy_import_says_why() -> None:
    assert [f"{file}:{line}" for file, line, excused in lazy_imports() if not excused] == []


def test_the_count_does_not_grow() -> None:
    assert len(lazy_imports()) <= MAX_LAZY_IMPORTS


def test_the_rule_sees_an_unexcused_import(tmp_path: Path) -> None:
    (tmp_path / "eagle3_assets").mkdir()
    (tmp_path / "eagle3_assets" / "m.py").write_text(
        "def f():\n    # lazy: loads torch\n    import torch\n    import numpy\n\n    import json\n"
    )
    assert lazy_imports(tmp_path / "eagle3_assets") == [
        ("eagle3_assets/m.py", 3, True),
        ("eagle3_assets/m.py", 4, True),
        ("eagle3_assets/m.py", 6, False),
    ]
