"""Shared fixtures: a temporary data directory, Dagster instance and resources for every test."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import dagster as dg
import pytest

from eagle3_assets.storage import DataLayout

# One session-scoped real vLLM server for every test that needs it (tests/conftest_vllm.py).
pytest_plugins = ["conftest_vllm"]

REPO_ROOT = Path(__file__).resolve().parent.parent


def write_jsonl(path: Path, rows: Iterable[object]) -> Path:
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(row if isinstance(row, str) else json.dumps(row))
            handle.write("\n")
    return path


@pytest.fixture
def layout(tmp_path: Path) -> DataLayout:
    return DataLayout.at(tmp_path / "data")


@pytest.fixture
def instance(tmp_path: Path) -> Iterable[dg.DagsterInstance]:
    # A real on-disk instance (SQLite), like the one `make dev` uses, not an in-memory stand-in.
    with dg.instance_for_test() as test_instance:
        yield test_instance


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
