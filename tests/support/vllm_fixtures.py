"""Session fixtures for tests against the real CPU vLLM server on the tiny local model.

One server per test session (start-up is ~70-120 s on 2 cores). tests/conftest.py registers this module for the
whole session (``pytest_plugins = ["support.vllm_fixtures"]``), so every test that names the ``vllm_server``
fixture shares the same server.

Skips (does not fail) when the vLLM interpreter (``$EAGLE3_VLLM_PYTHON`` or ``.venv-vllm``) is missing, so
``make test-fast`` and machines without the optional install still pass; ``make test`` installs it first.
Set ``EAGLE3_REQUIRE_VLLM=1`` (CI) to turn that skip into a failure.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from eagle3_assets.local.tiny_model import build_tiny_model
from eagle3_assets.local.vllm_server import (
    LocalVLLMServer,
    VLLMNotInstalledError,
    VLLMServerConfig,
    check_vllm_python,
)
from eagle3_assets.net.ports import find_free_port

TINY_MODEL_NAME = "tiny-llama"
TINY_MAX_MODEL_LEN = 1024


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / TINY_MODEL_NAME, seed=0)


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalVLLMServer]:
    try:
        python = check_vllm_python(import_check=True)
    except VLLMNotInstalledError as exc:
        if os.environ.get("EAGLE3_REQUIRE_VLLM", "").strip() in {"1", "true", "yes"}:
            pytest.fail(f"EAGLE3_REQUIRE_VLLM is set but the vLLM venv is unusable: {exc}")
        pytest.skip(f"local vLLM not installed (run `make install-vllm`): {exc}")
    config = VLLMServerConfig(
        model=tiny_model_dir,
        served_model_name=TINY_MODEL_NAME,
        port=find_free_port(),
        python=python,
        max_model_len=TINY_MAX_MODEL_LEN,
        log_dir=tmp_path_factory.mktemp("vllm-logs"),
    )
    with LocalVLLMServer(config) as server:
        yield server


@pytest.fixture(scope="session")
def vllm_tiny_verifier() -> Path:
    """The tests' cached tiny verifier, for tests that start their own vLLM on it (skipped without the vLLM venv)."""
    from support.hidden_states_data import cached_tiny_verifier

    try:
        check_vllm_python()
    except VLLMNotInstalledError as exc:
        pytest.skip(f"local vLLM not installed: {exc}")
    return cached_tiny_verifier()


@pytest.fixture(scope="session")
def hidden_states_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(base URL, shared storage folder) of a CPU vLLM in hidden-states extraction mode on the tests' cached tiny
    verifier (layer ids 1,2,3), started and stopped through ``eagle3 serve-local start/stop --hidden-states``."""
    import subprocess
    import sys

    from support.hidden_states_data import cached_tiny_verifier

    try:
        check_vllm_python()
    except VLLMNotInstalledError as exc:
        if os.environ.get("EAGLE3_REQUIRE_VLLM", "").strip() in {"1", "true", "yes"}:
            pytest.fail(f"EAGLE3_REQUIRE_VLLM is set but the vLLM venv is unusable: {exc}")
        pytest.skip(f"local vLLM not installed (run `make install-vllm`): {exc}")
    port = find_free_port()
    logs = tmp_path_factory.mktemp("hs-vllm-logs")
    storage = tmp_path_factory.mktemp("hs-transfer")
    cli = [sys.executable, "-m", "eagle3_assets.local.vllm_cli"]
    where = ["--port", str(port), "--log-dir", str(logs)]
    start = [*cli, "start", *where, "--model", str(cached_tiny_verifier()), "--served-model-name", "tiny-verifier"]
    subprocess.run([*start, "--hidden-states", "--layer-ids", "1,2,3", "--storage", str(storage)], check=True)
    try:
        yield f"http://127.0.0.1:{port}/v1", storage
    finally:
        subprocess.run([*cli, "stop", *where], check=True)
