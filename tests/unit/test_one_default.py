"""Each setting's default is written once: a ``setting(...)`` in ``defs/`` that shares its name with a field of the
core dataclass it is copied into reads that field's default (``setting(GenerationConfig.max_tokens, ...)``) instead
of repeating it as a literal. Checked on the source (``ast``), so no Dagster is loaded.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "eagle3_assets"

# (Dagster-side class, core dataclass it is turned into, fields allowed their own literal and why)
PAIRS: list[tuple[str, str, dict[str, str]]] = [
    ("InferenceServerResource", "GenerationConfig", {"model": "text field: empty is the core's None"}),
    ("HiddenStatesRunConfig", "HiddenStatesConfig", {}),
    ("HiddenStatesRunConfig", "VLLMBackendOptions", {}),
    ("DraftModelRunConfig", "TrainConfig", {}),
    ("DraftEvaluationRunConfig", "OnlineConfig", {}),
    (
        "DraftEvaluationRunConfig",
        "EvaluationOptions",
        {
            "partition": "text field: empty is the core's None",
            "offline_max_samples": "the asset caps the offline simulation; the core's default is the whole partition",
        },
    ),
]


def _classes(root: Path = PACKAGE) -> dict[str, ast.ClassDef]:
    found: dict[str, ast.ClassDef] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, node)
    return found


def _is_literal(node: ast.expr | None) -> bool:
    if isinstance(node, ast.UnaryOp):
        return _is_literal(node.operand)
    if isinstance(node, ast.Tuple | ast.List):
        return all(_is_literal(e) for e in node.elts)
    return isinstance(node, ast.Constant)


def _defaults(cls: ast.ClassDef) -> dict[str, ast.expr]:
    """field name -> its default expression (for a ``setting(...)``, the call's first argument)."""
    out: dict[str, ast.expr] = {}
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            value = stmt.value
            if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "setting" and value.args:
                value = value.args[0]
            elif isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
                value = next((k.value for k in value.keywords if k.arg == "default"), None)  # type: ignore[assignment]
            if value is not None:
                out[stmt.target.id] = value
    return out


def twice_declared(classes: dict[str, ast.ClassDef], pairs: list[tuple[str, str, dict[str, str]]] = PAIRS) -> list[str]:
    found = []
    for dagster_side, core, allowed in pairs:
        declared, core_defaults = _defaults(classes[dagster_side]), _defaults(classes[core])
        shared = sorted(set(declared) & set(core_defaults))
        assert shared, f"{dagster_side} and {core} share no field: the pair is stale"
        found += [
            f"{dagster_side}.{name} and {core}.{name}"
            for name in shared
            if name not in allowed and _is_literal(declared[name]) and _is_literal(core_defaults[name])
        ]
    return found


def test_no_setting_default_is_declared_twice() -> None:
    assert twice_declared(_classes()) == []


def test_the_check_sees_a_default_written_twice(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        "class Core:\n    a: int = 1\n    b: int = 2\n\n\n"
        "class Run:\n    a: int = setting(Core.a, description='')\n    b: int = setting(2, description='')\n"
    )
    assert twice_declared(_classes(tmp_path), [("Run", "Core", {})]) == ["Run.b and Core.b"]
