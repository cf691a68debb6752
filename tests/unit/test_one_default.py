"""Each setting's default is written once: a ``setting(...)`` (on a settings model or an asset's run config) that
shares its name with a field of the core dataclass it is copied into reads that field's default
(``setting(GenerationConfig.max_tokens, ...)``) instead of repeating it as a literal; no setting anywhere repeats the
literal default of a same-named field of any other class; no command line copies a core default. Checked on the
source (``ast``), so no Dagster is loaded.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "eagle3_assets"

# (Dagster-side class, core dataclass it is turned into, fields allowed their own literal and why)
PAIRS: list[tuple[str, str, dict[str, str]]] = [
    ("InferenceServerSettings", "GenerationConfig", {"model": "text field: empty is the core's None"}),
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


# ------------------------------------------------------------------ every setting against every other class


def _declares_settings(cls: ast.ClassDef) -> bool:
    return any(
        isinstance(stmt, ast.AnnAssign)
        and isinstance(stmt.value, ast.Call)
        and getattr(stmt.value.func, "id", None) == "setting"
        for stmt in cls.body
    )


def repeated_literals(classes: dict[str, ast.ClassDef]) -> list[str]:
    """Every setting whose literal default is the same literal as the default of a same-named field of another
    class (a config dataclass it feeds, or a sibling): one of them should read the other, or a named constant."""
    settings_classes = {name: cls for name, cls in classes.items() if _declares_settings(cls)}
    others = {name: _defaults(cls) for name, cls in classes.items() if not _declares_settings(cls)}
    found = []
    for name, cls in sorted(settings_classes.items()):
        for field_name, expr in sorted(_defaults(cls).items()):
            if not _is_literal(expr):
                continue
            value = ast.literal_eval(expr)
            found += [
                f"{name}.{field_name} and {other}.{field_name} (= {value!r})"
                for other, defaults in sorted(others.items())
                if field_name in defaults
                and _is_literal(defaults[field_name])
                and ast.literal_eval(defaults[field_name]) == value
            ]
    return found


def test_no_setting_repeats_another_classes_literal_default(tmp_path: Path) -> None:
    assert repeated_literals(_classes()) == []
    # and the check sees one
    (tmp_path / "m.py").write_text(
        "AUTO = 'auto'\n\n\nclass Train:\n    device: str = 'auto'\n    precision: str = AUTO\n\n\n"
        "class Settings:\n    device: str = setting('auto')\n    precision: str = setting('auto')\n"
    )
    assert repeated_literals(_classes(tmp_path)) == ["Settings.device and Train.device (= 'auto')"]


# ------------------------------------------------------------------ command lines copying a core default

COMMAND_LINES = ("eagle3_assets/cli", "eagle3_assets/operations", "benchmarks")


def _constants(root: Path) -> dict[str, object]:
    """Module-level ``NAME = literal`` of the package (the one declaration of a shared default)."""
    found: dict[str, object] = {}
    for path in sorted(root.rglob("*.py")):
        for stmt in ast.parse(path.read_text(encoding="utf-8")).body:
            named = isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            if named and _is_literal(stmt.value):  # type: ignore[union-attr]
                found.setdefault(stmt.targets[0].id, ast.literal_eval(stmt.value))  # type: ignore[union-attr]
    return found


def core_defaults(root: Path = PACKAGE) -> dict[str, set[str]]:
    """field name -> "Class=value" of every dataclass-style field whose default is a literal or a named constant."""
    constants = _constants(root)
    out: dict[str, set[str]] = {}
    for name, cls in _classes(root).items():
        for field_name, expr in _defaults(cls).items():
            if _is_literal(expr):
                value = ast.literal_eval(expr)
            elif isinstance(expr, ast.Name) and expr.id in constants:
                value = constants[expr.id]
            else:
                continue
            out.setdefault(field_name, set()).add(f"{name}={value!r}")
    return out


def copied_defaults(paths: list[Path], defaults: dict[str, set[str]]) -> list[str]:
    """``add_argument("--name", default=<literal>)`` whose literal is the default of a core field of that name
    (None, "not given", is no copy; a ``# own default: why`` comment on the call excuses a deliberate one)."""
    found = []
    for path in paths:
        lines = path.read_text(encoding="utf-8").splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument" and node.args):
                continue
            flag = node.args[0]
            default = next((k.value for k in node.keywords if k.arg == "default"), None)
            if not (isinstance(flag, ast.Constant) and isinstance(flag.value, str) and _is_literal(default)):
                continue
            call_lines = lines[node.lineno - 1 : node.end_lineno]
            if ast.literal_eval(default) is None or any(
                "# own default:" in line for line in [lines[node.lineno - 2], *call_lines]
            ):  # type: ignore[arg-type]
                continue
            dest = flag.value.lstrip("-").replace("-", "_")
            value = ast.literal_eval(default)  # type: ignore[arg-type]
            same = sorted(d for d in defaults.get(dest, ()) if d.endswith(f"={value!r}"))
            if same:
                found.append(f"{path.name}: {flag.value} default {value!r} copies {same[0]}")
    return found


def test_no_command_line_copies_a_core_default() -> None:
    root = PACKAGE.parent
    paths = [p for place in COMMAND_LINES for p in sorted((root / place).rglob("*.py"))]
    assert len(paths) > 10
    assert copied_defaults(paths, core_defaults()) == []


def test_the_check_sees_a_copied_command_line_default(tmp_path: Path) -> None:
    (tmp_path / "core.py").write_text("K = 3\n\n\nclass Online:\n    k: int = K\n    prompts: int = 32\n")
    cli = tmp_path / "cli.py"
    cli.write_text(
        "p.add_argument('--k', type=int, default=3)\np.add_argument('--prompts', default=Online.prompts)\n"
        "p.add_argument('--epochs', type=int, default=3)\n"
    )
    assert copied_defaults([cli], core_defaults(tmp_path)) == ["cli.py: --k default 3 copies Online=3"]
