"""The code location loads the whole ``defs/`` folder (``dg.load_from_defs_folder``): every asset and check that any
module there defines is in ``defs``, with no list of modules to keep in step."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import dagster as dg

import eagle3_assets.defs
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
    assert "load_from_defs_folder" in text
    for info in pkgutil.iter_modules(eagle3_assets.defs.__path__):
        if info.name not in ("automation", "registry"):
            assert f"defs.{info.name} " not in text and f"defs import {info.name}" not in text, info.name
