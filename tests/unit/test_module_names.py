"""One name per thing (issue 34): no two modules of the package share a file name, unless they are the same concept
at two layers (a Dagster asset in ``defs/`` and the engine it wraps) and the ``defs/`` module's docstring says so."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "eagle3_assets"
SAME_CONCEPT = "the same concept one layer up"  # the words a defs/ module's docstring uses for its engine


def shared_stems(root: Path = PACKAGE) -> dict[str, list[Path]]:
    by_stem: dict[str, list[Path]] = defaultdict(list)
    for path in root.rglob("*.py"):
        if path.stem not in ("__init__", "__main__"):
            by_stem[path.stem].append(path.relative_to(root))
    return {stem: sorted(paths) for stem, paths in by_stem.items() if len(paths) > 1}


def unexplained(root: Path = PACKAGE) -> list[str]:
    found = []
    for stem, paths in sorted(shared_stems(root).items()):
        layers = [p for p in paths if p.parts[0] == "defs"]
        docstring = ast.get_docstring(ast.parse((root / layers[0]).read_text(encoding="utf-8"))) if layers else None
        if len(paths) != 2 or len(layers) != 1 or SAME_CONCEPT not in " ".join((docstring or "").split()):
            found.append(f"{stem}: {', '.join(map(str, paths))}")
    return found


def test_no_two_modules_share_a_name_without_being_one_concept_at_two_layers() -> None:
    assert unexplained() == []


def test_the_name_check_sees_a_collision(tmp_path: Path) -> None:
    for path, text in {
        "defs/ablation.py": '"""The asset; its engine is evaluation/ablation.py (the same concept one layer up)."""',
        "evaluation/ablation.py": '"""The engine."""',
        "evaluation/checks.py": '"""Checks."""',
        "generation/checks.py": '"""Other checks."""',
        "defs/prompts.py": '"""Prompts."""',
        "prompts/prompts.py": '"""Prompts again, with no word of the layer."""',
    }.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text + "\n")
    assert unexplained(tmp_path) == [
        "checks: evaluation/checks.py, generation/checks.py",
        "prompts: defs/prompts.py, prompts/prompts.py",
    ]
