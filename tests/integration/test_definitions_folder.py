"""The code location loads the whole ``defs/`` folder (Dagster's component tree of ``eagle3_assets.defs``, what
``dg.load_from_defs_folder`` builds): every asset and check that any module there defines is in ``defs``, with no list
of modules to keep in step, from a checkout and from an installed package alike."""

from __future__ import annotations

import importlib
import os
import pkgutil
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import dagster as dg

import eagle3_assets.defs
from eagle3_assets.core.settings import PACKAGE_DIR
from eagle3_assets.definitions import build_definitions


def _declared_in_the_folder() -> set[str]:
    keys: set[str] = set()
    for info in pkgutil.iter_modules(eagle3_assets.defs.__path__, "eagle3_assets.defs."):
        for value in vars(importlib.import_module(info.name)).values():
            if isinstance(value, dg.AssetsDefinition):
                keys |= {key.to_user_string() for key in value.keys}
    return keys


def test_every_asset_of_the_defs_folder_is_loaded() -> None:
    loaded = build_definitions().resolve_asset_graph().get_all_asset_keys()
    declared = _declared_in_the_folder()
    assert len(declared) >= 7
    assert declared <= {key.to_user_string() for key in loaded}


def test_definitions_names_no_asset_module() -> None:
    text = (Path(eagle3_assets.defs.__path__[0]).parent / "definitions.py").read_text(encoding="utf-8")
    assert "ComponentTree.from_module(defs_module=eagle3_assets.defs" in text
    # the dg CLI in a checkout reads [tool.dg]: it names the same folder
    dg_project = tomllib.loads((PACKAGE_DIR.parent / "pyproject.toml").read_text())["tool"]["dg"]["project"]
    assert dg_project["defs_module"] == eagle3_assets.defs.__name__
    for info in pkgutil.iter_modules(eagle3_assets.defs.__path__):
        if info.name not in ("automation", "registry"):
            assert f"defs.{info.name} " not in text and f"defs import {info.name}" not in text, info.name


def test_an_installed_package_loads_with_no_project_file_above_it(tmp_path: Path) -> None:
    """A deployment installs the wheel (an image's ``pip install .``): no pyproject.toml or dg.toml above the package.
    The code location loads there all the same; ``load_from_defs_folder`` looked for that file and failed."""
    site = tmp_path / "site-packages"
    shutil.copytree(PACKAGE_DIR, site / "eagle3_assets", ignore=shutil.ignore_patterns("__pycache__"))
    script = (
        "import eagle3_assets.definitions as d\n"
        "print(d.__file__)\n"
        "print(len(d.defs.resolve_asset_graph().get_all_asset_keys()))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site), "EAGLE3_DATA_DIR": str(tmp_path / "data")}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded_from, asset_count = done.stdout.split()
    assert loaded_from.startswith(str(site))  # the copy, not the checkout
    assert int(asset_count) == len(build_definitions().resolve_asset_graph().get_all_asset_keys())
