"""The synthetic-response generation engine (Dagster-free): a continuously refilled request pool against
one or more vLLM OpenAI-compatible servers, with classified retries, an append-only journal and resume.

Entry point: :func:`generate_partition`.
"""

from __future__ import annotations

from eagle3_assets.generation.generation_config import GenerationConfig
from eagle3_assets.generation.partition_run import generate_partition, partition_prompts
from eagle3_assets.generation.records import (
    COLUMNS,
    RESPONSE_SCHEMA,
    STATUS_FAILED,
    STATUS_OK,
    PromptToGenerate,
)
from eagle3_assets.generation.run_common import GenerationResult

__all__ = [
    "COLUMNS",
    "RESPONSE_SCHEMA",
    "STATUS_FAILED",
    "STATUS_OK",
    "GenerationConfig",
    "GenerationResult",
    "PromptToGenerate",
    "generate_partition",
    "partition_prompts",
]
