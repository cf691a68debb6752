"""The package's imports run one way: no circles, and only the entry points reach up into the Dagster layer.

The graph is drawn with ``ast`` from every import in a module, the ones inside functions included (a lazy import
still ties two modules together), with relative imports resolved. An edge names a module of the package; an import
of a package (``from eagle3_assets.local import x``) points at its ``__init__`` unless ``x`` is itself a module.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "eagle3_assets"
# Only these may import eagle3_assets.defs or eagle3_assets.definitions: the command line, the demo and the
# operations (they load the Definitions to run or inspect them); defs/ and definitions.py themselves.
MAY_IMPORT_DEFS = (
    f"{PACKAGE}.cli",
    f"{PACKAGE}.demo",
    f"{PACKAGE}.operations",
    f"{PACKAGE}.defs",
    f"{PACKAGE}.definitions",
)


def _modules(root: Path) -> dict[str, Path]:
    found = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _targets(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``module`` imports anywhere in its body."""
    found: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, is_package, node)
            names = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source for alias in node.names]
        for name in names:
            # `import a.b.c` names a.b.c; walk up to the longest prefix that is a module of the package.
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = _modules(root)
    return {module: _targets(module, path, known) for module, path in known.items()}


def _is_package_init_edge(graph: dict[str, set[str]], source: str, target: str) -> bool:
    # A package's __init__ re-exporting its own submodules (and a submodule importing a sibling through the
    # package) is one unit, not a circle between layers: skip edges from a package to its own children.
    return target.startswith(source + ".")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if _is_package_init_edge(graph, node, target):
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(groups)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports of defs/ or definitions from a module that is not an entry point."""
    layer = (f"{PACKAGE}.defs", f"{PACKAGE}.definitions")
    found = []
    for source, targets in sorted(graph.items()):
        if any(source == allowed or source.startswith(allowed + ".") for allowed in MAY_IMPORT_DEFS):
            continue
        found += [
            f"{source} -> {t}" for t in sorted(targets) if any(t == top or t.startswith(top + ".") for top in layer)
        ]
    return found


def test_no_import_circles() -> None:
    assert cycles(import_graph()) == []


def test_only_entry_points_import_the_dagster_layer() -> None:
    assert upward_imports(import_graph()) == []


def test_the_graph_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    pkg = tmp_path / PACKAGE
    (pkg / "defs").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "defs" / "__init__.py").write_text("")
    (pkg / "defs" / "x.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "b.py").write_text("from eagle3_assets.a import f\n")
    (pkg / "c.py").write_text("from .defs import x\n")
    graph = import_graph(tmp_path)
    assert cycles(graph) == [[f"{PACKAGE}.a", f"{PACKAGE}.b"]]
    assert upward_imports(graph) == [f"{PACKAGE}.c -> {PACKAGE}.defs.x"]


# The rooms of the package from the bottom up: a module imports its own room and rooms below it, never one above,
# so each room can be read, tested and replaced knowing only what lies under it. Stages follow the data
# (prompts -> responses -> hidden states -> draft -> evaluation); the Dagster layer and the entry points sit on top.
ROOMS = (
    "__init__",  # the package's version
    "core",  # settings, the data layout and atomic writes, hashing, lineage of files, partition keys, processes
    "speculators_adapter",  # every speculators import, loaded lazily
    "net",  # what every stage that talks to a server shares: endpoint pool, credentials, ports, bounded bodies
    "prompts",  # dataset files -> normalized conversations -> the raw_prompts table
    "local",  # the embedded vLLM servers, the tiny and the real verifier, accelerators, CUDA locks
    "generation",
    "hidden_states",
    "training",
    "evaluation",
    "planning",
    "environment",  # every declared EAGLE3_* setting and its value, Dagster-free
    "defs",  # the Dagster layer
    "definitions",
    "operations",  # backfill, status, sync, the demo: they run the Definitions
    "cli",
)


def room_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_room_imports(graph: dict[str, set[str]]) -> list[str]:
    rank = {room: i for i, room in enumerate(ROOMS)}
    return [
        f"{source} -> {target}"
        for source, targets in sorted(graph.items())
        for target in sorted(targets)
        if rank[room_of(target)] > rank[room_of(source)]
    ]


def test_every_module_is_in_a_known_room() -> None:
    assert sorted({room_of(m) for m in import_graph()} - set(ROOMS)) == []


def test_rooms_import_only_the_rooms_below_them() -> None:
    assert upward_room_imports(import_graph()) == []


def test_the_room_rule_sees_an_upward_import() -> None:
    graph = {f"{PACKAGE}.core.storage": {f"{PACKAGE}.hidden_states.publish"}, f"{PACKAGE}.hidden_states.publish": set()}
    assert upward_room_imports(graph) == [f"{PACKAGE}.core.storage -> {PACKAGE}.hidden_states.publish"]
