"""Conversations and settings shared by the generation safety tests (issue 31), the all-turns kill test and their
child processes."""

from __future__ import annotations

from eagle3_assets.generation import GenerationConfig, PromptToGenerate
from support.reliability import fast_config


def prompts(n: int = 6, turns: int = 2, tag: str = "safe", answer: str = "dataset answer") -> list[PromptToGenerate]:
    """``n`` conversations ``{tag}-000``... of ``turns`` user turns (the dataset's assistant answers between them:
    ``{answer} {k}``)."""
    return [
        PromptToGenerate(
            f"{tag}-{i:03d}",
            [
                message
                for k in range(turns)
                for message in (
                    {"role": "user", "content": f"conversation {i} question {k}"},
                    {"role": "assistant", "content": f"{answer} {k}"},
                )
            ][:-1],
        )
        for i in range(n)
    ]


def config(url: str, regenerate: str, **overrides: object) -> GenerationConfig:
    """The fake model, 8 requests in flight, short replies and a 10 s request timeout; the connection and bench
    settings the library's own."""
    values: dict[str, object] = dict(
        model="fake-model", concurrency=8, max_tokens=400, regenerate=regenerate, request_timeout_s=10.0
    )
    return fast_config(url, **{**values, **overrides})
