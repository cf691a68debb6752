"""Fixtures for every tier: a temporary data directory and Dagster instance.

Tiers: ``unit/`` tests the Dagster-free core (in-process fake server and tiny model allowed), ``integration/``
runs Dagster, the CLI and subprocess fault/kill scenarios against the fake server, ``e2e/`` needs the real
CPU vLLM or a browser. Shared helpers live in ``support/`` (test-only, never shipped).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import dagster as dg
import pytest

from eagle3_assets.core.storage import DataLayout

# One session-scoped real vLLM server for every test that needs it.
pytest_plugins = ["support.vllm_fixtures", "support.real_model", "support.stand_in_vllm"]


@pytest.fixture
def layout(tmp_path: Path) -> DataLayout:
    return DataLayout.at(tmp_path / "data")


@pytest.fixture
def instance(tmp_path: Path) -> Iterable[dg.DagsterInstance]:
    # A real on-disk instance (SQLite), like the one `make dev` uses, not an in-memory stand-in.
    with dg.instance_for_test() as test_instance:
        yield test_instance
