"""A house a newcomer can walk: a few files at the package root, rooms that say what they own, one name per thing.

A module's stem names one concept: two modules (or a module and a room) share a stem only when they are the same
concept at two layers, an asset in ``defs/`` and its engine, and then the ``defs/`` module's docstring says so.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "eagle3_assets"
MAX_ROOT_MODULES = 6
SAME_CONCEPT = "the same concept one layer up"


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""


def test_few_modules_at_the_root() -> None:
    assert len(list(PACKAGE.glob("*.py"))) <= MAX_ROOT_MODULES


def test_every_room_says_what_it_owns() -> None:
    rooms = [p for p in PACKAGE.iterdir() if p.is_dir() and any(p.glob("*.py"))]
    assert len(rooms) > 5
    silent = [r.name for r in rooms if not (r / "__init__.py").exists() or not _docstring(r / "__init__.py")]
    assert silent == []


def stem_clashes(package: Path) -> list[str]:
    """Stems used by more than one module or room, unless one is a ``defs/`` module that says it is the same
    concept one layer up."""
    places: dict[str, list[Path]] = defaultdict(list)
    for path in sorted(package.rglob("*.py")):
        if path.name == "__init__.py":
            if path.parent != package:
                places[path.parent.name].append(path)
        else:
            places[path.stem].append(path)
    clashes = []
    for stem, paths in sorted(places.items()):
        if len(paths) < 2:
            continue
        layered = [p for p in paths if p.parent.name == "defs" and SAME_CONCEPT in " ".join(_docstring(p).split())]
        if len(paths) == 2 and layered:
            continue
        clashes.append(f"{stem}: " + ", ".join(str(p.relative_to(package.parent)) for p in paths))
    return clashes


def test_one_name_per_thing() -> None:
    assert stem_clashes(PACKAGE) == []


def test_the_name_rule_sees_a_clash_and_an_excused_pair(tmp_path: Path) -> None:
    pkg = tmp_path / "eagle3_assets"
    for room in ("generation", "training", "defs", "evaluation"):
        (pkg / room).mkdir(parents=True)
        (pkg / room / "__init__.py").write_text('"""A room."""\n')
    (pkg / "generation" / "config.py").write_text("")
    (pkg / "training" / "config.py").write_text("")
    (pkg / "defs" / "evaluation.py").write_text(
        f'"""The asset.\n\nThe Dagster layer of evaluation/ ({SAME_CONCEPT}).\n"""\n'
    )
    assert stem_clashes(pkg) == ["config: eagle3_assets/generation/config.py, eagle3_assets/training/config.py"]
