"""Helpers every test tier uses: paths, small file writers, resources, and the environment of child processes."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from eagle3_assets.storage import DataLayout

TESTS_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = TESTS_DIR.parent


def python_path() -> str:
    """PYTHONPATH for a child interpreter: the repository (``eagle3_assets``) and ``tests/`` (``support``)."""
    parts = [str(REPO_ROOT), str(TESTS_DIR)]
    inherited = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join(parts + ([inherited] if inherited else []))


def child_env(**extra: str) -> dict[str, str]:
    """The current environment plus what a child Python process needs to import the project and ``support``."""
    return {**os.environ, "PYTHONPATH": python_path(), "PYTHONUNBUFFERED": "1", **extra}


def write_jsonl(path: Path, rows: Iterable[object]) -> Path:
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(row if isinstance(row, str) else json.dumps(row))
            handle.write("\n")
    return path


def make_resources(layout: DataLayout, prompts_path: Path, partition_size: int = 1000, **extra: object) -> dict:
    from eagle3_assets.defs.resources import DataStoreResource, PromptDatasetResource

    return {
        "data_store": DataStoreResource(data_dir=str(layout.root)),
        "prompt_dataset": PromptDatasetResource(path=str(prompts_path), partition_size=partition_size),
        **extra,
    }


def error_chain(error: BaseException) -> str:
    """All messages of an exception and its causes (Dagster wraps user errors)."""
    parts, seen = [], set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:  # contexts can form a cycle
        seen.add(id(current))
        parts.append(str(current))
        current = current.__cause__ or current.__context__
    return "\n".join(parts)
