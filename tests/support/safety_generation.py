"""Prompts and settings shared by the generation safety tests (issue 31) and their child processes."""

from __future__ import annotations

from eagle3_assets.generation import GenerationConfig, PromptToGenerate


def prompts(n: int = 6, turns: int = 2) -> list[PromptToGenerate]:
    """``n`` conversations of ``turns`` user turns (the dataset's assistant answers between them)."""
    return [
        PromptToGenerate(
            f"safe-{i:03d}",
            [
                message
                for k in range(turns)
                for message in (
                    {"role": "user", "content": f"conversation {i} question {k}"},
                    {"role": "assistant", "content": f"dataset answer {k}"},
                )
            ][:-1],
        )
        for i in range(n)
    ]


def config(url: str, regenerate: str, **overrides: object) -> GenerationConfig:
    values: dict[str, object] = dict(
        base_urls=[url],
        model="fake-model",
        concurrency=8,
        max_tokens=400,
        regenerate=regenerate,
        request_timeout_s=10.0,
        backoff_base_s=0.05,
        backoff_max_s=0.5,
        fsync_interval_s=0.2,
        progress_interval_s=1.0,
    )
    values.update(overrides)
    return GenerationConfig(**values)  # type: ignore[arg-type]
