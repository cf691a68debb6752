"""generation/fingerprint.py: what a request fingerprint covers, and what it deliberately leaves out."""

from __future__ import annotations

from eagle3_assets.generation import GenerationConfig, PromptToGenerate
from eagle3_assets.generation.fingerprint import FingerprintInputs, fingerprints_for, prompt_set_digest

URL = "http://127.0.0.1:9/v1"
PROMPTS = [PromptToGenerate("a", [{"role": "user", "content": "hello"}])]


def fingerprint(model: str = "m", revision: str | None = None, **config: object) -> str:
    params = GenerationConfig(base_urls=[URL], **config).sampling_params()  # type: ignore[arg-type]
    return fingerprints_for(FingerprintInputs(model, params, revision), PROMPTS)["a"]


def test_what_determines_the_answer_changes_the_fingerprint() -> None:
    base = fingerprint()
    assert fingerprint() == base  # deterministic
    for changed in (
        fingerprint(model="other"),
        fingerprint(revision="content:1"),
        fingerprint(max_tokens=9000),
        fingerprint(temperature=0.7),
        fingerprint(top_p=0.9),
        fingerprint(seed=1),
        fingerprint(extra_sampling={"chat_template_kwargs": {"enable_thinking": False}}),
    ):
        assert changed != base
    other_prompt = [PromptToGenerate("a", [{"role": "user", "content": "hello!"}])]
    params = GenerationConfig(base_urls=[URL]).sampling_params()
    assert fingerprints_for(FingerprintInputs("m", params), other_prompt)["a"] != base


def test_how_a_request_travels_does_not_change_the_fingerprint() -> None:
    """Raising concurrency, a longer timeout, streaming or another transport must not throw finished rows away."""
    base = fingerprint()
    assert base == fingerprint(concurrency=7, request_timeout_s=5.0, stream=True, transport="aiohttp")
    assert base == fingerprint(return_token_ids=False, max_attempts=2)


def test_prompt_set_digest_sees_appended_edited_and_dropped_prompts() -> None:
    rows = [("a", [{"role": "user", "content": "x"}]), ("b", [{"role": "user", "content": "y"}])]
    base = prompt_set_digest(rows)
    assert prompt_set_digest(list(reversed(rows))) == base  # order-independent
    assert prompt_set_digest([*rows, ("c", [{"role": "user", "content": "z"}])]) != base
    assert prompt_set_digest([rows[0], ("b", [{"role": "user", "content": "y2"}])]) != base
    assert prompt_set_digest(rows[:1]) != base
